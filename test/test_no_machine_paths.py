"""No tracked file names a path of one machine: data comes from a flag or a variable (with a
documented default relative to the checkout, e.g. ../shared/data), docs' commands write under the
repository or a fresh temp folder, and no script removes a fixed path under /tmp (two users or
two runs on one machine would delete each other's files).

Measurement records (benchmarks/results/*.json, *.txt) keep the paths their run used: they say
what happened on that machine, and are exempt.
"""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a home, a workspace or a mount of one machine (not after ~, $VAR, a word or a dot: ~/.cache,
# $HOME/x and relative paths are fine)
MACHINE_PATH = re.compile(r"(?<![\w.~$}/-])/(work|home|root|Users|mnt|scratch|srv|data)/")
FIXED_TMP_REMOVAL = re.compile(r"\brm\s+(-\w+\s+)*[\"']?/tmp/|\w+=[\"']?/tmp/[\w./-]*[\"']?;?\s*rm\s")
TMP_PATH = re.compile(r"(?<![\w.~$}/-])/tmp/")
RECORDS = re.compile(r"^benchmarks/results/.*\.(json|txt)$")
# scripts/gpu/ documents and uses the lent GPU machine's own layout (one user, wiped after use)
GPU_MACHINE = re.compile(r"^scripts/gpu/")


def _tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = []
    for rel in out.splitlines():
        path = os.path.join(ROOT, rel)
        if RECORDS.match(rel) or not os.path.isfile(path) or rel == "test/test_no_machine_paths.py":
            continue
        with open(path, "rb") as f:
            head = f.read(8192)
        if b"\0" not in head:
            files.append(rel)
    return files


def _hits(pattern: re.Pattern, files: list[str]) -> list[str]:
    hits = []
    for rel in files:
        with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if pattern.search(line):
                    hits.append(f"{rel}:{n}: {line.strip()[:160]}")
    return hits


def test_no_tracked_file_names_a_machine_path():
    assert _hits(MACHINE_PATH, _tracked_text_files()) == []


def test_no_script_removes_a_fixed_path_under_tmp():
    assert _hits(FIXED_TMP_REMOVAL, _tracked_text_files()) == []


def test_docs_commands_use_no_fixed_tmp_path():
    docs = [f for f in _tracked_text_files() if f.endswith(".md") and not GPU_MACHINE.match(f)]
    assert _hits(TMP_PATH, docs) == []


def test_the_patterns_catch_what_they_name():
    assert MACHINE_PATH.search('PROSE = "/work/shared/data/x.jsonl"') and MACHINE_PATH.search("/home/me/m")
    assert not MACHINE_PATH.search("~/.cache/sgl_kvxfer") and not MACHINE_PATH.search("../shared/data/x")
    assert not MACHINE_PATH.search("benchmarks/work/x") and not MACHINE_PATH.search("$HOME/data/x")
    assert FIXED_TMP_REMOVAL.search('W=/tmp/scd_work; rm -rf "$W"') and FIXED_TMP_REMOVAL.search("rm -rf /tmp/x")
    assert not FIXED_TMP_REMOVAL.search('W=$(mktemp -d); trap \'rm -rf "$W"\' EXIT')
    assert TMP_PATH.search("--model-path /tmp/l8b") and not TMP_PATH.search("OUT=$(mktemp -d)")
