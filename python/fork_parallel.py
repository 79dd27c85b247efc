"""s.fork(n): branches share the prefix, generate in parallel, and are joined back."""
import sys

import sglang as sgl
from _common import DEFAULT_URL, connect

TOPICS = ["fruit", "animal", "color"]


@sgl.function
def brainstorm(s):
    s += "Give one example for each category.\n"
    forks = s.fork(len(TOPICS))
    for f, topic in zip(forks, TOPICS):
        f += f"An example of a {topic} is"
        f += sgl.gen("example", max_tokens=5, stop=[".", "\n"], temperature=0)
    forks.join()
    for topic, f in zip(TOPICS, forks):
        s += f"{topic}:{f['example']}\n"
    s += "Summary:" + sgl.gen("summary", max_tokens=12, temperature=0)


def main(url: str = DEFAULT_URL) -> dict:
    connect(url)
    state = brainstorm.run()
    text = state.text()
    result = {"examples": {t: line.split(":", 1)[1] for t in TOPICS for line in text.splitlines()
                           if line.startswith(t + ":")}, "summary": state["summary"]}
    print(result)
    return result


if __name__ == "__main__":
    main(*sys.argv[1:2])
