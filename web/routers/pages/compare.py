"""``/compare?runs=A,B,C``: several runs overlaid on one set of charts (picked on the runs
list), to compare strategies: accuracy against rounds, wall time, simulated time or uplink
bytes, cumulative bytes, and consensus distance for decentralized runs."""

from __future__ import annotations

import re

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse

from fedswarm.web.services import queries
from fedswarm.web.services.accounts import Principal
from fedswarm.web.deps import WebContext, get_ctx, page_user
from fedswarm.web.routers.pages.common import render
from fedswarm.web.models import RUN_ID_PATTERN

__all__ = ["router", "MAX_COMPARE"]

router = APIRouter(include_in_schema=False)
MAX_COMPARE = 8
_RUN_ID = re.compile(RUN_ID_PATTERN)


@router.get("/compare", response_class=HTMLResponse)
def compare_page(request: Request, runs: str = Query("", max_length=400), p: Principal = Depends(page_user),
                 ctx: WebContext = Depends(get_ctx)):
    ids = list(dict.fromkeys(x.strip() for x in runs.split(",") if x.strip()))
    bad = [x for x in ids if not _RUN_ID.match(x)]
    error = None
    if bad:
        error = f"not a run id: {bad[0]!r}"
        ids = [x for x in ids if x not in bad]
    if len(ids) > MAX_COMPARE:
        error = f"at most {MAX_COMPARE} runs on one chart; showing the first {MAX_COMPARE}"
        ids = ids[:MAX_COMPARE]
    found = {r.id: r for r in (ctx.store.get_run(i) for i in ids) if r is not None}
    missing = [i for i in ids if i not in found]
    if missing:
        error = f"no run '{missing[0]}' in the store"
    stats = queries.stats_for(ctx.store, list(found))
    summaries = [queries.summary_of(found[i], stats.get(i, {}), ctx.settings.report_timeout_s)
                 for i in ids if i in found]
    return render(request, ctx, p, "compare.html", runs=summaries, error=error)
