"""sgl.gen with max_tokens and a stop string."""
import sys

import sglang as sgl
from _common import DEFAULT_URL, connect


@sgl.function
def capital_qa(s, country):
    s += f"Q: What is the capital of {country}?\nA:"
    s += sgl.gen("answer", max_tokens=16, stop="\n", temperature=0)
    s += "\nQ: Name one famous landmark there.\nA:"
    s += sgl.gen("landmark", max_tokens=6, temperature=0)


def main(url: str = DEFAULT_URL) -> dict:
    connect(url)
    state = capital_qa.run(country="France")
    result = {"answer": state["answer"], "landmark": state["landmark"],
              "landmark_tokens": state.get_meta_info("landmark")["completion_tokens"]}
    print(result)
    return result


if __name__ == "__main__":
    main(*sys.argv[1:2])
