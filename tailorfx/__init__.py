"""tailorfx: graph rewrites that make LLM training fit a memory budget and run fast.

    opt = tailorfx.optimize(model, budget="24GB", example_inputs=batch)
    compiled = torch.compile(model, backend="tailorfx")
"""
from tailorfx import attention
from tailorfx.api import OptimizedModule, optimize
from tailorfx.backend import tailorfx_backend
from tailorfx.budget import Budget
from tailorfx.codegen.schedule import simulate_schedule
from tailorfx.errors import BudgetError, PredictionError
from tailorfx.runtime.measure import measure_peak
from tailorfx.runtime.optim import SetupOptimizer
from tailorfx.setup import PRESETS, TrainingSetup
from tailorfx.sizing import max_seq_len, sequence_bound

__all__ = ["attention", "optimize", "max_seq_len", "sequence_bound", "OptimizedModule", "PredictionError", "Budget", "BudgetError", "measure_peak", "tailorfx_backend",
           "TrainingSetup", "PRESETS", "SetupOptimizer", "simulate_schedule"]
__version__ = "0.1.0"
