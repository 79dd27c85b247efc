"""Shared-prefix fan-out: run_batch of questions behind one long common prefix.

The DSL first sends the prefix alone (`cache_prefix`, max_new_tokens=0), so the server's prefix
cache serves it to every question; `cached_tokens` in meta_info shows the hits."""
import sys

import sglang as sgl
from _common import DEFAULT_URL, connect

PREFIX = ("You are a geography tutor. Paris is the capital of France, Berlin is the capital of "
          "Germany, Rome is the capital of Italy, Madrid is the capital of Spain and Lisbon is the "
          "capital of Portugal. Answer each question with one word.\n")
COUNTRIES = ["France", "Germany", "Italy", "Spain", "Portugal", "France", "Italy", "Germany"]


@sgl.function
def ask(s, country):
    s += PREFIX
    s += f"Q: What is the capital of {country}?\nA:"
    s += sgl.gen("answer", max_tokens=4, stop="\n", temperature=0)


def main(url: str = DEFAULT_URL) -> dict:
    connect(url)
    states = ask.run_batch([{"country": c} for c in COUNTRIES], num_threads=4)
    answers = [st["answer"] for st in states]
    cached = [st.get_meta_info("answer")["cached_tokens"] for st in states]
    result = {"answers": answers, "cached_tokens": cached, "num_prompts": len(COUNTRIES)}
    print(result)
    return result


if __name__ == "__main__":
    main(*sys.argv[1:2])
