"""scripts/fusedkv/results_tables.py: the retrofit block states the fitted budget, or that the fit
puts the target out of reach (curve.extrapolate's beyond_minutes)."""
import copy
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts", "fusedkv"))

import results_tables  # noqa: E402

REPORT = os.path.join(ROOT, "benchmarks", "results", "fusedkv_retrofit_smollm2-135m-instruct_NVIDIA_H200.json")


def test_retrofit_lines_for_a_reachable_and_an_out_of_reach_target():
    report = {**json.load(open(REPORT)), "_file": os.path.basename(REPORT)}
    far = copy.deepcopy(report)
    far["extrapolation"]["code"].update(minutes_to_target=None, beyond_minutes=1e6)
    code, = [l for l in results_tables.retrofit(report) if l.startswith("- code:")]
    far_code, = [l for l in results_tables.retrofit(far) if l.startswith("- code:")]
    assert code.endswith(f"target at {report['extrapolation']['code']['minutes_to_target']:.1f} GPU-minutes")
    assert far_code.endswith("target beyond 1e+06 GPU-minutes")
