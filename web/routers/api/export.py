"""/api/runs/{id}/rounds.csv, rounds.jsonl, nodes.csv and nodes.jsonl: a run's rounds or
per-node rounds as files, streamed from the store by :func:`fedswarm.export.export` (the
writer ``fedswarm runs export`` uses, so both give the same bytes). Any reader may export."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException
from fastapi.responses import StreamingResponse

from fedswarm import export
from fedswarm.web import models
from fedswarm.web.services.accounts import Principal
from fedswarm.web.deps import RunIdPath, WebContext, get_ctx, require_reader

__all__ = ["router"]

router = APIRouter(prefix="/api/runs", tags=["export"])
ERRORS = {401: {"model": models.Message}, 403: {"model": models.Message}, 404: {"model": models.Message}}


def _download(ctx: WebContext, run_id: str, kind: str, fmt: str) -> StreamingResponse:
    try:
        chunks = export.export(ctx.store, run_id, kind, fmt)
    except KeyError as exc:
        raise HTTPException(404, exc.args[0]) from None
    name = export.filename(run_id, kind, fmt)
    return StreamingResponse(chunks, media_type=export.FORMATS[fmt],
                             headers={"Content-Disposition": f'attachment; filename="{name}"'})


def _route(kind: str, fmt: str, what: str) -> None:
    content = {export.FORMATS[fmt].split(";")[0]: {"schema": {"type": "string"}}}

    def download(run_id: str = RunIdPath, _: Principal = Depends(require_reader),
                 ctx: WebContext = Depends(get_ctx)) -> StreamingResponse:
        return _download(ctx, run_id, kind, fmt)

    file = f"{'rounds' if kind == 'rounds' else 'nodes'}.{fmt}"
    download.__name__ = f"export_{kind}_{fmt}"
    router.add_api_route(
        f"/{{run_id}}/{file}", download, methods=["GET"], response_class=StreamingResponse,
        summary=f"Export {what} as {'CSV' if fmt == 'csv' else 'JSON Lines'}",
        description=f"The run's {what}, one a row, streamed. " + export.describe(kind),
        responses={200: {"content": content, "description": f"{what} ({fmt})"}, **ERRORS})


for _kind, _what in (("rounds", "rounds"), ("nodes", "per-node rounds (one row per node and round)")):
    for _fmt in export.FORMATS:
        _route(_kind, _fmt, _what)
