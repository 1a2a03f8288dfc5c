"""The run page's secure-aggregation card: per round participants, dropouts recovered, the
protocol's byte overhead and epsilon, read from the round's metrics as SecAggGrid writes them
(defensively: a malformed entry shows blanks), and whether the config asked for it."""

from __future__ import annotations

import re


def _row(**over):
    sa = {"participants": 10, "nodes": {"advertise": 10, "share_keys": 10, "masked_input": 8, "unmask": 8},
          "bytes": {"advertise": {"down": 1000, "up": 500}, "share_keys": {"down": 2000, "up": 2500},
                    "masked_input": {"down": 40000, "up": 40000}, "unmask": {"down": 700, "up": 1300}},
          "dropped_after_sharing": 2, "recovered": 2, "threshold": 6, "degree": 9, "field_bits": 32, "refused": {}}
    sa.update(over)
    return sa


def test_run_page_shows_secure_rounds(app, admin):
    store = app.state.ctx.store
    rid = store.create_run({"rounds": 3, "strategy": "fedavg", "secagg": True}, name="secure")
    store.add_round(rid, 1, bytes_up=1, bytes_down=1, secagg=_row(), epsilon=1.25, delta=1e-5)
    store.add_round(rid, 2, bytes_up=1, bytes_down=1, secagg=_row(participants="x", bytes=None),
                    secagg_failed="only 3 nodes sent a masked input")
    page = admin.get(f"/runs/{rid}").text
    assert 'id="secagg"' in page and "is <b>on</b>" in page
    body = page.split('id="secagg-table"')[1].split("</table>")[0]
    cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>.*?</td>", body)]
    # round 1: 10 participants, 8 masked, 2 dropped after sharing, 2 recovered, t 6, 32 bits,
    # protocol bytes 8000 over the masked-input stage's 80000: 10.0 %, epsilon 1.250
    assert cells[:7] == ["1", "10", "8", "2", "2", "6", "32"] and cells[8:10] == ["10.0%", "1.250"]
    # round 2, malformed figures: blanks, and the failure's reason
    assert cells[11:13] == ["2", ""] and "only 3 nodes sent a masked input" in cells


def test_run_page_without_secagg_has_no_card(app, admin):
    rid = app.state.ctx.store.create_run({"rounds": 1, "strategy": "fedavg"}, name="plain")
    app.state.ctx.store.add_round(rid, 1, bytes_up=1, bytes_down=1)
    assert 'id="secagg"' not in admin.get(f"/runs/{rid}").text


def test_config_asking_for_secagg_shows_the_card_before_any_round(app, admin):
    rid = app.state.ctx.store.create_run({"rounds": 1, "strategy": "fedavg", "secagg": True}, name="waiting")
    page = admin.get(f"/runs/{rid}").text
    assert "is <b>on</b>" in page and 'id="secagg-empty"' in page
