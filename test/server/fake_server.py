"""`python test/server/fake_server.py <launch_server flags>`: the real launcher and HTTP stack
over `fake_scheduler` (no model weights)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_scheduler import run_fake_scheduler  # noqa: E402

from sgl_kvxfer.launch_server import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:], scheduler_target=run_fake_scheduler)
