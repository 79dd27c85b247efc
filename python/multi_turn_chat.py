"""Multi-turn chat: system, user and assistant roles rendered with the ChatML template."""
import sys

import sglang as sgl
from _common import DEFAULT_URL, connect


@sgl.function
def chat(s, questions):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    for i, question in enumerate(questions):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=24, temperature=0))


def main(url: str = DEFAULT_URL) -> dict:
    connect(url)
    questions = ["What is the capital of France?", "And what river flows through it?"]
    state = chat.run(questions=questions)
    result = {"answers": [state[f"answer_{i}"] for i in range(len(questions))],
              "num_messages": len(state.messages())}
    print(result)
    return result


if __name__ == "__main__":
    main(*sys.argv[1:2])
