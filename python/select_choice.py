"""sgl.select: the server scores each choice by prompt logprobs."""
import sys

import sglang as sgl
from _common import DEFAULT_URL, connect

CHOICES = ["Paris", "London", "Berlin"]


@sgl.function
def pick_capital(s):
    s += "The capital city of France is"
    s += " " + sgl.select("city", choices=CHOICES, temperature=0)
    s += ". It is known for"
    s += sgl.gen("fact", max_tokens=8, temperature=0)


def main(url: str = DEFAULT_URL) -> dict:
    connect(url)
    state = pick_capital.run()
    result = {"city": state["city"], "fact": state["fact"], "choices": CHOICES}
    print(result)
    return result


if __name__ == "__main__":
    main(*sys.argv[1:2])
