"""stream=True: the DSL reads the cumulative SSE text and yields deltas."""
import sys

import sglang as sgl
from _common import DEFAULT_URL, connect


@sgl.function
def story(s):
    s += "Once upon a time, in a small village,"
    s += sgl.gen("story", max_tokens=24, temperature=0)


def main(url: str = DEFAULT_URL) -> dict:
    connect(url)
    state = story.run(stream=True)
    pieces = list(state.text_iter(var_name="story"))
    result = {"pieces": len(pieces), "streamed": "".join(pieces), "final": state["story"]}
    print(result)
    return result


if __name__ == "__main__":
    main(*sys.argv[1:2])
