"""FastAPI app assembly. The TokenizerManager is created by the launcher and started inside
uvicorn's event loop (lifespan), because its zmq sockets belong to that loop."""
from __future__ import annotations

import contextlib
import sys
import time

from fastapi import FastAPI

from sgl_kvxfer.config import ServerArgs
from sgl_kvxfer.server import native, openai_api
from sgl_kvxfer.server.auth import AuthMiddleware
from sgl_kvxfer.server.errors import install_exception_handlers


def create_app(server_args: ServerArgs, tokenizer_manager, launch_command: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await tokenizer_manager.start()
        try:
            yield
        finally:
            await tokenizer_manager.stop()

    app = FastAPI(title="sgl_kvxfer", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.server_args = server_args
    app.state.tm = tokenizer_manager
    app.state.startup_time = time.time()
    app.state.launch_command = launch_command or " ".join(sys.argv)
    install_exception_handlers(app)
    app.include_router(native.router)
    app.include_router(openai_api.router)
    if server_args.api_key or server_args.admin_api_key:
        app.add_middleware(AuthMiddleware, api_key=server_args.api_key, admin_api_key=server_args.admin_api_key)
    return app
