"""tests/fast_start, which every Python the tests start runs: the collector is back on once torch and torchvision
are imported, what they made is left out of its walks, and a hook earlier on PYTHONPATH still runs it (the
stand-in accelerator's, and the copy checker's, whose users may have a sitecustomize of their own)."""
import json
import os
import sys

import pytest

from helpers import ROOT, run

PROBE = ("import gc, json, torch, torchvision; "
         "print(json.dumps([gc.isenabled(), gc.get_freeze_count(), torch.cuda.is_available()]))")


@pytest.mark.parametrize("hook, env", [(None, {}), ("tests/stand_in_accelerator", {"STAND_IN_ACCELERATOR": "cuda"}),
                                       ("tools/copy_hook", {})], ids=["alone", "after-a-test-hook", "after-copy-hook"])
def test_the_collector_skips_torchs_objects_and_runs_after_the_import(hook, env, tmp_path):
    path = os.pathsep.join(filter(None, [hook and str(ROOT / hook), os.environ["PYTHONPATH"]]))
    env = {**env, "PYTHONPATH": path, "STAND_IN_LOG": str(tmp_path / "log")}
    enabled, frozen, cuda = json.loads(run([sys.executable, "-c", PROBE], env=env, timeout=60).stdout)
    assert enabled, "the collector was left off after the import"
    assert frozen > 100_000, f"only {frozen} objects left out of the collector's walks"
    assert cuda == (hook == "tests/stand_in_accelerator"), "the hook before fast_start did not run"
