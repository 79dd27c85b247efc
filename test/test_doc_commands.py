"""Every command the docs print runs as printed, or its block says why not (test/doc_check.py
has the rules). Blocks that need the same servers share one start."""
import json
import os
import subprocess
import sys

import pytest
from doc_check import ROOT, all_blocks, annotation_errors, ci_lines, group_spec, groups, netns_prefix, port_busy
from servers import scaled


def test_doc_check_annotations_are_known_and_say_why():
    assert annotation_errors(all_blocks()) == []


def test_every_command_block_runs_or_says_why_not():
    bs = all_blocks()
    assert len(bs) > 10  # the docs' command blocks were found
    grouped = {b.where for g in groups(bs) for b in g.blocks}
    for b in bs:
        assert b.kind in ("gpu", "long", "skip", "api", "ran-by") or b.where in grouped, b.where
    for g in groups(bs):
        for b in g.blocks:
            assert b.commands() or b.lang == "python", f"{b.where}: an empty command block"


@pytest.mark.slow
@pytest.mark.parametrize("group", groups(), ids=lambda g: g.name)
def test_doc_commands_run_as_printed(group, tmp_path):
    prefix = netns_prefix()
    spec, problems = group_spec(group, ci_lines(), netns=prefix is not None)
    assert problems == []
    if prefix is None:
        busy = [s for s in spec["servers"] if port_busy(int(s.split("--port ")[1].split()[0]) if "--port " in s else 30000)]
        if busy:
            pytest.skip(f"no network namespace here and a printed port is busy: {busy}")
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([*(prefix or []), sys.executable, os.path.join(ROOT, "test", "doc_check.py"),
                           str(spec_path), str(out_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled(1500))
    assert proc.returncode == 0 and out_path.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out_path.read_text())
    logs = "\n".join(report["server_logs"])
    assert report["error"] is None, f"{report['error']}\nserver logs:\n{logs}"
    for r in report["results"]:
        assert r["rc"] == 0, f"{r['where']} failed (exit {r['rc']}):\n{r['output']}\nserver logs:\n{logs}"
    assert report["left"] == [], "the docs' commands wrote these files into the checkout"
