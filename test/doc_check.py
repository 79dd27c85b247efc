"""Every command the docs print runs as printed (test/test_doc_commands.py drives this in CI).

Which docs: README.md, docs/*.md, kernels/README.md, the READMEs under benchmarks/ and the
package READMEs (DOCS). Which commands: the fenced ```bash / ```sh / ```python blocks; a
```text block (GPU call lists, diagrams) and an unfenced or indented snippet are not commands.
Nor is an inline `code` span: in prose it names a command, and in the benchmark tables it is the
command behind a recorded measurement (GPU or minutes long), whose script
test/benchmarks/test_bench_smoke.py runs at tiny shapes. A command meant to be copied and run
goes in a fenced block.

A block runs unless the line just above its fence says otherwise, in an HTML comment that the
rendered page hides:

    <!-- doc-check: gpu -->                 needs a CUDA device or the lent GPU machine
    <!-- doc-check: long: REASON -->        runs longer than CI allows (REASON says how long)
    <!-- doc-check: skip: REASON -->        cannot run as printed (REASON: what it needs)
    <!-- doc-check: api -->                 an API listing, not a program
    <!-- doc-check: ran-by: TEST_FILE -->   TEST_FILE runs these commands (it names each script
                                             and every argument printed; it may add --out-dir)
    <!-- doc-check: with-server: COMMAND --> runs against the server COMMAND starts (a server
                                             line printed in another block)

How a block runs:
- A server line (`python -m sgl_kvxfer.launch_server ...`, `python -m sglang_router.launch_router
  ...`) starts in the background; the block's other commands run once every server answers
  (`/health`, the router's `/readiness`), each as printed, in one bash (`set -e`), from the repo
  root. Blocks that need the same servers share one start (a group).
- A `curl` command must print a JSON object without an `error` key (curl exits 0 on a 4xx); a
  `sglang.bench_serving` command must report every one of its `--num-prompts` requests successful.
- A line that .ci/run runs verbatim (the README's install and test commands) is CI's own; a
  `python -m pytest test/...` line is part of CI's `python -m pytest test`: its paths must exist.
- A ```python block runs as a script.
- Each group runs in its own network namespace (`unshare -rn`) where available, so the printed
  ports never meet another process's; elsewhere on the host's loopback, skipped if a port is busy.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", "docs/*.md", "kernels/README.md", "benchmarks/README.md", "benchmarks/*/README.md",
        "sgl_kvxfer/*/README.md")
RUN_LANGS = ("bash", "sh", "shell", "python")
KINDS = ("gpu", "long", "skip", "api", "with-server", "ran-by")
SERVER = re.compile(r"^(python3? -m (sgl_kvxfer\.launch_server|sglang_router\.launch_router)|sgl-kvxfer-server)\b")
FENCE = re.compile(r"^```(\S*)\n(.*?)^```", re.S | re.M)
BENCH_RESULT = re.compile(r"sglang_\d{4}_\d+_\d+_\d+\.jsonl")  # bench_serving's default output file
NOTE = re.compile(r"<!--\s*doc-check:\s*([\w-]+)\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclasses.dataclass
class Block:
    path: str
    line: int
    lang: str
    text: str
    kind: str | None = None  # an annotation kind, or None: runs
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def commands(self) -> list[str]:
        """Shell commands: backslash continuations and lines inside an open quote joined as
        bash joins them; comment-only and empty lines dropped."""
        out, cur = [], ""
        for raw in self.text.splitlines():
            cur += raw
            if cur.endswith("\\"):
                cur = cur[:-1] + " "
                continue
            try:
                shlex.split(cur, comments=True)
            except ValueError:  # an open quote: the command goes on
                cur += "\n"
                continue
            if cur.strip() and not cur.lstrip().startswith("#"):
                out.append(cur.strip())
            cur = ""
        return out

    def servers(self) -> list[str]:
        return [c for c in self.commands() if SERVER.match(c)]


def doc_files() -> list[str]:
    files = []
    for pattern in DOCS:
        files += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    return list(dict.fromkeys(f for f in files if not os.path.islink(os.path.join(ROOT, os.path.dirname(f)))))


def blocks(path: str) -> list[Block]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    found = []
    for m in FENCE.finditer(text):
        lang = m.group(1).lower()
        if lang not in RUN_LANGS:
            continue
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        note = NOTE.search(before)
        block = Block(path, line, lang, m.group(2))
        if note:
            block.kind, block.reason = note.group(1), (note.group(2) or "").strip()
        found.append(block)
    return found


def all_blocks() -> list[Block]:
    return [b for f in doc_files() for b in blocks(f)]


def annotation_errors(bs: list[Block]) -> list[str]:
    errors = []
    for b in bs:
        if b.kind is None:
            continue
        if b.kind not in KINDS:
            errors.append(f"{b.where}: unknown doc-check kind {b.kind!r} (one of {KINDS})")
        elif b.kind in ("long", "skip", "with-server", "ran-by") and not b.reason:
            errors.append(f"{b.where}: doc-check {b.kind} needs a reason or a command after ':'")
        elif b.kind == "ran-by":
            errors += ran_by_errors(b)
    return errors


def ran_by_errors(b: Block) -> list[str]:
    """The test file named exists and names every command's script and each of its arguments."""
    path = os.path.join(ROOT, b.reason)
    if not os.path.isfile(path):
        return [f"{b.where}: ran-by {b.reason}: no such file"]
    with open(path) as f:
        test = f.read()
    errors = []
    for cmd in b.commands():
        args = shlex.split(cmd, comments=True)
        script = args[1] if args[0].startswith("python") else args[0]
        for token in [script.removeprefix("benchmarks/"), *args[2:]]:
            if token not in test:
                errors.append(f"{b.where}: {b.reason} does not run {token!r} of `{cmd}`")
    return errors


def ci_lines() -> set[str]:
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        return {line.strip() for line in f}


@dataclasses.dataclass
class Group:
    """Blocks that run against the same servers (none: a block alone)."""
    servers: tuple[str, ...]
    blocks: list[Block]

    @property
    def name(self) -> str:
        return self.blocks[0].where


def groups(bs: list[Block] | None = None) -> list[Group]:
    bs = all_blocks() if bs is None else bs
    out: dict[tuple, Group] = {}
    for b in bs:
        if b.kind not in (None, "with-server"):
            continue
        servers = tuple(b.servers()) if b.kind is None else (b.reason,)
        # one start for servers whose commands differ only in comments
        key = tuple(" ".join(shlex.split(s, comments=True)) for s in servers) or (b.where,)
        out.setdefault(key, Group(servers, [])).blocks.append(b)
    return list(out.values())


def client_script(b: Block, ci: set[str], json_dir: str) -> tuple[str, list[str]]:
    """The block's non-server commands as one bash script (curl's and bench_serving's output
    captured to check), and problems found without running (pytest paths that do not exist)."""
    lines, problems = ["set -e -o pipefail"], []
    for i, cmd in enumerate(b.commands()):
        if SERVER.match(cmd) or cmd in ci or cmd + " || exit 1" in ci:
            continue
        if cmd.startswith("python -m pytest "):
            paths = [a for a in shlex.split(cmd, comments=True)[3:] if not a.startswith("-")]
            problems += [f"{b.where}: {p} does not exist" for p in paths if not os.path.exists(os.path.join(ROOT, p))]
            continue
        # a newline ends a trailing comment before the redirect
        if cmd.startswith("curl "):
            lines.append(f"{{ {cmd}\n}} > {json_dir}/{i}.curl")
        elif "sglang.bench_serving" in cmd:
            lines.append(f"{{ {cmd}\n}} 2>&1 | tee {json_dir}/{i}.bench")
        else:
            lines.append(cmd)
    return "\n".join(lines) + "\n", problems


def _untracked() -> set[str]:
    out = subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True)
    return set(out.stdout.splitlines())


def _curl_problem(body: str) -> str | None:
    try:
        reply = json.loads(body)
    except ValueError:
        reply = None
    if isinstance(reply, dict) and "error" not in reply:
        return None
    return f"curl printed no JSON reply without an error: {body[:500]!r}"


def _bench_problem(body: str, block: dict, name: str) -> str | None:
    cmd = Block("", 0, "bash", block["text"]).commands()[int(name.split(".")[0])]
    args = shlex.split(cmd, comments=True)
    want = args[args.index("--num-prompts") + 1] if "--num-prompts" in args else None
    if want and re.search(rf"Successful requests:\s+{want}\b", body):
        return None
    return f"bench_serving did not report {want} successful requests:\n{body[-1500:]}"


def _port(cmd: str) -> int:
    args = shlex.split(cmd, comments=True)
    return int(args[args.index("--port") + 1]) if "--port" in args else 30000


def _ready_path(cmd: str) -> str:
    return "/readiness" if "launch_router" in cmd else "/health"


def _lo_up() -> None:
    """Bring up the loopback of a fresh network namespace (SIOCGIFFLAGS / SIOCSIFFLAGS)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, struct.pack("16sh", b"lo", 0)))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 1))


def _answers(port: int, path: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def run_group(spec: dict) -> dict:
    """Inside the namespace (or on the host): start the servers, run each block, stop them.
    Returns {"results": [{where, rc, output}], "error": str|None, "server_logs": [...]}."""
    from sgl_kvxfer.testing.servers import STARTUP_TIMEOUT, Deadline

    if spec["netns"]:
        _lo_up()
    work = tempfile.mkdtemp(prefix="doc_check_")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    untracked_before = _untracked()
    procs, logs, report = [], [], {"results": [], "error": None, "server_logs": [], "left": []}
    try:
        for i, cmd in enumerate(spec["servers"]):
            log = os.path.join(work, f"server{i}.log")
            logs.append(log)
            procs.append(subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, env=env, stdout=open(log, "w"),
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = Deadline(STARTUP_TIMEOUT)
        waiting = list(zip(spec["servers"], procs))
        while waiting and not deadline.expired():
            for cmd, proc in list(waiting):
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}: {cmd}")
                if _answers(_port(cmd), _ready_path(cmd)):
                    waiting.remove((cmd, proc))
            time.sleep(0.2)
        if waiting:
            raise RuntimeError(f"not ready in {deadline}: {[c for c, _ in waiting]}")
        for b in spec["blocks"]:
            json_dir = tempfile.mkdtemp(dir=work)
            if b["lang"] == "python":
                script = os.path.join(work, "block.py")
                with open(script, "w") as f:
                    f.write(b["text"])
                argv = [sys.executable, script]
            else:
                argv = ["bash", "-c", b["script"].replace("{json_dir}", json_dir)]
            out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
            result = {"where": b["where"], "rc": out.returncode, "output": (out.stdout + out.stderr)[-4000:]}
            for name in sorted(os.listdir(json_dir)):
                with open(os.path.join(json_dir, name)) as f:
                    body = f.read()
                problem = _curl_problem(body) if name.endswith(".curl") else _bench_problem(body, b, name)
                if problem:
                    result["rc"] = result["rc"] or 1
                    result["output"] += "\n" + problem
            report["results"].append(result)
    except Exception as e:  # noqa: BLE001 (reported to the test)
        report["error"] = f"{type(e).__name__}: {e}"
    finally:  # stopped as a user stops them: SIGTERM to the launcher, which stops its children
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything of its session still alive
            except ProcessLookupError:
                pass
        for log in logs:
            with open(log, errors="replace") as f:
                report["server_logs"].append(f.read()[-3000:])
        subprocess.run(["rm", "-rf", work])
        # bench_serving writes its result file into the working directory (the repo root, where
        # the docs' commands run); the check removes the ones it made, and nothing else
        for path in sorted(_untracked() - untracked_before):
            if BENCH_RESULT.fullmatch(path):
                os.remove(os.path.join(ROOT, path))
            else:
                report["left"].append(path)
    return report


def netns_prefix() -> list[str] | None:
    """`unshare -rn` (a user + network namespace: private ports, no privileges needed where the
    kernel allows it), `unshare -n` as root, or None where neither works."""
    for prefix in (["unshare", "-rn"], ["unshare", "-n"]):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0:
                return prefix
        except (OSError, subprocess.SubprocessError):
            pass
    return None


def group_spec(g: Group, ci: set[str], netns: bool) -> tuple[dict, list[str]]:
    problems, blocks_ = [], []
    for b in g.blocks:
        script, p = client_script(b, ci, "{json_dir}")
        problems += p
        blocks_.append({"where": b.where, "lang": b.lang, "text": b.text, "script": script})
    return {"servers": list(g.servers), "blocks": blocks_, "netns": netns}, problems


def port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


if __name__ == "__main__":  # python test/doc_check.py SPEC.json OUT.json (run by the test, in the namespace)
    with open(sys.argv[1]) as f:
        spec_ = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump(run_group(spec_), f)
