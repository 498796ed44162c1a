"""benchmarks/gpu_scale.py --dry-run: every section of the 8B scale run, on a 2-layer Llama on CPU, so
the script a lent GPU runs first does not rot between loans (a few minutes: `make test-slow`)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_dry_run_runs_every_section(tmp_path):
    out = tmp_path / "gpu_scale.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_scale.py"), "--dry-run", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    data = json.loads(out.read_text())
    assert list(data["sections"]) == ["longest", "speed", "offload", "probe"]
    for name, sec in data["sections"].items():
        bad = [(c["name"], c.get("error", c)) for c in sec["checks"] if c["status"] not in ("pass", "skipped")]
        assert sec["status"] == "ok" and not bad, (name, bad)
        # only a peer that is not installed here is skipped, and it says how to carry it
        assert all("not installed" in c["reason"] or "needs DeepSpeed" in c["reason"]
                   for c in sec["checks"] if c["status"] == "skipped"), name
    longest = {c["name"]: c for c in data["sections"]["longest"]["checks"]}
    S = longest["max_seq_len"]["predicted_longest"]
    assert longest["train at the longest length"]["tokens"] == S
    assert "cannot be met" in longest["next granule refused"]["refused"]
    speed = {c["name"]: c for c in data["sections"]["speed"]["checks"]}
    for S in (256, 512):
        assert speed[f"tailorfx S={S}"]["fired"]["logits_skipped"]          # the fused head ran
        assert speed[f"hf-checkpointing S={S}"]["fired"]["checkpointing"]
        # the same model: checkpointing holds less than eager
        assert (speed[f"hf-checkpointing S={S}"]["measured"]["dynamic_peak"]
                < speed[f"eager S={S}"]["measured"]["dynamic_peak"])
    assert speed["agreement tailorfx"]["status"] == "pass"
    offload = {c["name"]: c for c in data["sections"]["offload"]["checks"]}
    assert offload["offloaded at its longest"]["host_bytes_predicted"] > 0
    probe = data["sections"]["probe"]["checks"][0]
    assert probe["returncode"] == 0 and probe["tokens"] == longest["max_seq_len"]["predicted_longest"] + 64
