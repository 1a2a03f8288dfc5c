"""The swarm peer: a process that trains on its own partition and gossips with peers.

A peer is a composition, as in decentralizepy: an identity and a verifier (who may talk
to us), a transport (sockets, byte counters), a membership table (who is alive; the
topology follows from the sorted member ids), and a *driver*: the algorithm's round,
built on the algorithm objects (:mod:`fedswarm.swarm.drivers`, :mod:`fedswarm.swarm.adpsgd`).

Each round: local steps, send this round's message, wait (with a timeout) for the
neighbours', mix with whoever answered, evaluate, checkpoint (atomically) and record. A
restarted peer loads its checkpoint, rejoins through gossip and continues from the next
round (catching up if its neighbours moved on while it was down).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from fedswarm.config import LearningRate, LocalSteps, TrainingSpec, round_seed
from fedswarm.swarm.checkpoint import load_checkpoint, save_checkpoint
from fedswarm.swarm.net.envelope import Dropped, Message, Verifier
from fedswarm.swarm.net.identity import create_or_load, load_allow_list
from fedswarm.swarm.net.inbox import Inbox
from fedswarm.swarm.net.membership import Membership, View
from fedswarm.swarm.net.payload import vector_body
from fedswarm.swarm.net.transport import (
    Session,
    Transport,
    client_tls_context,
    parse_addr,
    permissioned_tls,
    server_tls_context,
)

__all__ = ["Peer", "PeerConfig"]

log = logging.getLogger("fedswarm.swarm")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class PeerConfig(TrainingSpec):
    """Everything one peer needs. Times in seconds. The training fields (task, partition,
    seed, rounds, local_steps, batch_size, lr, topology, params, device) are fedswarm's
    :class:`~fedswarm.config.TrainingSpec`, checked as a run's are; a peer's defaults differ."""

    local_steps: LocalSteps = 10
    lr: LearningRate = 0.1
    listen: str = "127.0.0.1:0"
    join: list[str] = Field(default_factory=list)
    algorithm: str = "dpsgd"
    partition_id: int = 0
    num_partitions: int = 1
    keys: str | None = None
    allow: str | None = None
    insecure_allow_any: bool = False
    state_dir: str = "peer-state"
    min_peers: int = 1
    start_timeout_s: float = 60.0
    round_timeout_s: float = 10.0
    heartbeat_s: float = 0.5
    suspect_after: int = 4
    remove_after: int = 8
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    swarm_ca: str | None = None  # permissioned swarm: mutual TLS with certificates this CA issued
    tls_crl: str | None = None  # the swarm CA's revocation list
    encrypt: bool = True  # without TLS: a Noise handshake per connection, every byte encrypted (forward secret)
    legacy_static_keys: bool = False  # ... or, for older peers, static-key body encryption: NO forward secrecy
    max_body_mb: int = 1024
    save_models: bool = False
    eval_every: int = 1
    linger_s: float = 5.0
    min_round_s: float = 0.0  # pace: a round lasts at least this long (demos, failure tests)
    threads: int = 1  # torch intra-op threads (0: torch's default)
    db: str | None = None
    report_url: str | None = None
    token: str | None = None
    run_id: str | None = None
    data_path: str | None = None  # the peer's own dataset (--data) instead of a partition
    label_column: str = "label"
    val_fraction: float = 0.2

    def local_data(self):
        """``--data`` as a :class:`~fedswarm.tasks.localdata.LocalDataSpec`, or None."""
        from fedswarm.tasks.localdata import LocalDataSpec

        return LocalDataSpec(self.data_path, self.label_column, self.val_fraction) if self.data_path else None

    def check(self) -> None:
        host, _ = parse_addr(self.listen)
        if self.insecure_allow_any and host not in LOOPBACK:
            raise ValueError("--insecure-allow-any is for loopback demos only; listen on 127.0.0.1 or pass --allow")
        if not self.insecure_allow_any and not self.allow and not self.swarm_ca:
            raise ValueError("a peer needs --swarm-ca CA.pem (permissioned swarm), --allow FILE (admitted public "
                             "keys), or --insecure-allow-any on loopback")
        if self.swarm_ca and not self.tls_cert:
            raise ValueError("a permissioned swarm (--swarm-ca) needs --tls-cert: this peer's certificate")
        if bool(self.tls_cert) != bool(self.tls_key) and not self.swarm_ca:
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.legacy_static_keys and not self.encrypt:
            raise ValueError("--legacy-static-keys is a kind of encryption; it cannot go with --no-encrypt")
        if not 0 <= self.partition_id < self.num_partitions:
            raise ValueError(f"partition-id must be in 0..{self.num_partitions - 1} (got {self.partition_id})")


class Peer:
    """One swarm peer; ``run()`` trains ``cfg.rounds`` rounds and returns its summary."""

    def __init__(self, cfg: PeerConfig, *, identity=None):
        from fedswarm.swarm.drivers import make_driver

        from fedswarm.config import RunConfig
        from fedswarm.params import get_flat
        from fedswarm.train import task_data, trainer_for

        cfg.check()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.dir = Path(cfg.state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ident = identity or create_or_load(cfg.keys or self.dir / "keys")
        self.id = self.ident.peer_id
        # a permissioned swarm admits by certificate (bound to the signing key), not by list
        allowed = None if cfg.insecure_allow_any or (cfg.swarm_ca and not cfg.allow) \
            else load_allow_list(cfg.allow) | {self.id}
        self.verifier = Verifier(self.ident, allowed, max_body_bytes=cfg.max_body_mb << 20)
        host, port = parse_addr(cfg.listen)
        if cfg.swarm_ca:
            key = cfg.tls_key or str(Path(cfg.keys or self.dir / "keys") / "private.pem")
            tls_s, tls_c = permissioned_tls(cfg.swarm_ca, cfg.tls_cert, key, self.id, cfg.tls_crl)
        else:
            tls_s = server_tls_context(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None
            tls_c = client_tls_context(cfg.tls_ca) if cfg.tls_cert else None
        self.transport = Transport(self.ident, self.verifier, self._handle, host=host, port=port,
                                   tls_server=tls_s, tls_client=tls_c, bind_identity=bool(cfg.swarm_ca),
                                   encrypt=cfg.encrypt and tls_s is None, static_keys=cfg.legacy_static_keys,
                                   io_timeout_s=max(30.0, cfg.round_timeout_s))
        # the bound address (``--listen HOST:0`` picks a free port), for launchers: they read it
        # rather than guess a free port beforehand, which another process may take first.
        # Connections queue in the socket's backlog until start() accepts them.
        self._publish("address", self.transport.address)
        self.membership = Membership(self.id, self.transport.address, admit=self.verifier.admit,
                                     interval_s=cfg.heartbeat_s, suspect_after=cfg.suspect_after,
                                     remove_after=cfg.remove_after)
        self.inbox = Inbox()
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="push")
        self.run_cfg = RunConfig(task=cfg.task, partition=cfg.partition, seed=cfg.seed,
                                 clients=cfg.num_partitions, device=cfg.device)
        self.trainer = trainer_for(self.run_cfg, cfg.partition_id, cfg.num_partitions, local=cfg.local_data())
        self.x0 = get_flat(self.trainer.task.model(cfg.seed))  # every peer starts from the same init
        self.d = int(self.x0.numel())
        self.trainer.fit(self.x0, steps=1, batch_size=cfg.batch_size, lr=0.0)  # warm up torch before round 1
        self.test = task_data(self.run_cfg)
        self.round = 0
        self.history: list[dict] = []
        self.restarts = 0
        self.driver = make_driver(self)
        self.recorder = None
        self._done_peers: set[str] = set()
        self._hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)

    # -- messaging -----------------------------------------------------------------------
    def _handle(self, msg: Message, s: Session) -> None:
        if msg.kind in ("join", "gossip"):
            self.membership.merge(msg.meta.get("members"))
            s.send("members", {"members": self.membership.digest()}, re=msg.nonce)
        elif msg.kind in self.driver.push_kinds:
            r = msg.meta.get("round")
            if not isinstance(r, int) or isinstance(r, bool):
                self.verifier.count("malformed")
                s.send("nack", {"reason": "malformed"}, re=msg.nonce)
                return
            try:
                value = self.driver.accept(msg)
            except Dropped as exc:
                self.verifier.count(exc.reason)
                log.warning("%s: refused %s from %s: %s", self.ident.short_id, msg.kind, msg.sender[:8], exc)
                s.send("nack", {"reason": exc.reason}, re=msg.nonce)
                return
            stored = self.inbox.put(msg.kind, r, msg.sender, value)
            s.send("ack", {"stored": stored, **self.driver.ack_meta(msg)}, re=msg.nonce)
        elif not self.driver.serve(msg, s):
            self.verifier.count("malformed")
            s.send("nack", {"reason": f"unknown kind {msg.kind!r}"}, re=msg.nonce)

    def push(self, targets: list[str], kind: str, r: int, body=b"", meta: dict | None = None) -> dict[str,
                                                                                                      Message | None]:
        """Send ``kind`` for round ``r`` to each target in parallel; their ack (or None)."""
        meta = {**(meta or {}), "round": r}
        futures = {t: self.pool.submit(self._send_one, t, kind, meta, body) for t in targets}
        return {t: f.result() for t, f in futures.items()}

    def _send_one(self, target: str, kind: str, meta: dict, body) -> Message | None:
        addr = self.membership.addr_of(target)
        if addr is None:
            return None
        try:
            resp = self.transport.request(addr, target, kind, meta, body, timeout=self.cfg.round_timeout_s)
            return resp if resp.kind == "ack" else None
        except (OSError, Dropped) as exc:
            log.info("%s: %s to %s failed: %s", self.ident.short_id, kind, target[:8], exc)
            return None

    def send_model(self, targets: list[str], kind: str, r: int, x: torch.Tensor, meta: dict | None = None):
        m, body = vector_body(x)
        return self.push(targets, kind, r, body, {**m, **(meta or {})})

    # -- membership ----------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        while not self.stop.wait(self.cfg.heartbeat_s):
            self.membership.beat()
            for m in self.membership.gossip_targets():
                try:
                    resp = self.transport.request(m.addr, m.peer_id, "gossip", {"members": self.membership.digest()},
                                                  timeout=max(1.0, 2 * self.cfg.heartbeat_s), retries=0)
                    self.membership.merge(resp.meta.get("members"))
                except (OSError, Dropped):
                    pass
            if self.recorder is not None:
                self.recorder.tick()  # before check(): a member it removes leaves its gossiped stats with us
            for event, pid in self.membership.check():
                if event == "suspected" and self.membership.info_of(pid).get("done"):
                    self._done_peers.add(pid)  # it finished: its silence is no failure
                level = logging.INFO if pid in self._done_peers else logging.WARNING
                log.log(level, "%s: peer %s %s", self.ident.short_id, pid[:8], event)

    def _join(self) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        pending = [a for a in self.cfg.join if a != self.transport.address]
        delay = 0.05
        while pending and time.monotonic() < deadline and not self.stop.is_set():
            for addr in list(pending):
                try:
                    host, port = parse_addr(addr)
                    resp = self.transport.request(f"{host}:{port}", "", "join",
                                                  {"members": self.membership.digest()}, timeout=5.0, retries=0)
                    self.membership.merge(resp.meta.get("members"))
                    pending.remove(addr)
                except (OSError, Dropped):
                    pass
            if pending:
                time.sleep(delay)
                delay = min(1.0, delay * 2)
        if pending and len(pending) == len(self.cfg.join):
            raise RuntimeError(f"could not reach any join peer ({', '.join(self.cfg.join)})")
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while self.membership.count() < self.cfg.min_peers:
            if time.monotonic() > deadline or self.stop.is_set():
                raise RuntimeError(f"only {self.membership.count()} of {self.cfg.min_peers} peers "
                                   f"showed up within {self.cfg.start_timeout_s:.0f} s")
            time.sleep(0.05)

    def view(self) -> View:
        return self.membership.view(self.cfg.topology, self.cfg.seed)

    # -- training ------------------------------------------------------------------------
    def train(self, x: torch.Tensor, r: int):
        """``local_steps`` plain SGD steps from ``x`` with this round's minibatch seed (the
        seed every runtime uses: :func:`~fedswarm.config.round_seed`)."""
        c = self.cfg
        return self.trainer.fit(x, steps=c.local_steps, batch_size=c.batch_size, lr=c.lr,
                                seed=round_seed(c.seed, r, c.partition_id))

    def evaluate(self, x: torch.Tensor) -> tuple[float, float]:
        return self.trainer.evaluate(x, self.test.test_x, self.test.test_y)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        ckpt = load_checkpoint(self.dir)
        if ckpt is not None:
            self.round = int(ckpt["round"])
            self.history = list(ckpt["history"])
            self.restarts = int(ckpt.get("restarts", 0)) + 1
            self.driver.load_state_dict(ckpt["driver"])
            self.membership.set_info(round=self.round)
            log.warning("%s: resumed from checkpoint at round %d", self.ident.short_id, self.round)
        self.transport.start()
        self._hb.start()
        if self.cfg.db or self.cfg.report_url:
            from fedswarm.swarm.report import Recorder

            self.recorder = Recorder(self)
        self._join()

    def run(self) -> dict:
        """Train to ``cfg.rounds``; returns the summary also written to result.json."""
        t_start = time.time()
        try:
            self.start()
            r = self.round
            while r < self.cfg.rounds and not self.stop.is_set():
                # Catch-up jumps to the round the neighbours are in: one past their last completed
                # round, unless that was the final one; then the final round is still ours to train
                # (their round-R messages wait in the inbox). Without the clamp a peer one round
                # behind finished peers ends on a model that never saw round R.
                r = min(self.driver.next_round(r + 1), self.cfg.rounds)
                self.inbox.set_round(r)
                self._one_round(r)
            self.membership.set_info(done=True)
            self._farewell()
            self._linger()
        finally:
            summary = self.finish(time.time() - t_start)
        return summary

    def _one_round(self, r: int) -> None:
        view = self.view()
        sent0, recv0 = self.transport.stats.totals()
        t0 = time.perf_counter()
        row = {"round": r, "index": view.index, "members": view.n}
        row.update(self.driver.round(r, view))
        x = self.driver.model()
        if r % self.cfg.eval_every == 0 or r == self.cfg.rounds:
            row["test_loss"], row["test_accuracy"] = self.evaluate(x)
        sent1, recv1 = self.transport.stats.totals()
        row.update(bytes_up=sent1 - sent0, bytes_down=recv1 - recv0, wall_s=time.perf_counter() - t0,
                   t=time.time(), restarts=self.restarts)
        self.round = r
        self.history.append(row)
        stats = [{k: row.get(k) for k in ("round", "train_loss", "test_accuracy", "bytes_up", "bytes_down")}
                 for row in self.history[-3:]]
        self.membership.set_info(round=r, stats=stats, n=self.trainer.num_examples)
        if self.cfg.save_models:
            (self.dir / "models").mkdir(exist_ok=True)
            np.save(self.dir / "models" / f"r{r:05d}.npy", x.numpy())
        save_checkpoint(self.dir, {"round": r, "history": self.history, "restarts": self.restarts,
                                   "driver": self.driver.state_dict()})
        self._publish("round", str(r))  # progress, for launchers
        if self.recorder is not None:
            self.recorder.round_done(row)
        log.info("%s: round %d acc=%s loss=%.4f %.2fs", self.ident.short_id, r, row.get("test_accuracy"),
                 row.get("train_loss") or float("nan"), row["wall_s"])
        if self.cfg.min_round_s:
            self.stop.wait(max(0.0, self.cfg.min_round_s - (time.perf_counter() - t0)))

    def _farewell(self) -> None:
        """Send our entry (done, the last rounds' stats) to every member now: the last peer to
        finish may see the others done and stop before its next beat would have carried it."""
        others = [p for p in self.membership.ids() if p != self.id]
        self.push(others, "gossip", self.round, meta={"members": self.membership.digest()})

    def _linger(self) -> None:
        """Keep serving until every member is done (or ``linger_s`` passes): a late
        neighbour can still exchange with us."""
        deadline = time.monotonic() + self.cfg.linger_s
        while time.monotonic() < deadline and not self.stop.is_set():
            if all(self.membership.info_of(p).get("done") for p in self.membership.ids()):
                break
            time.sleep(0.05)

    def finish(self, wall_s: float) -> dict:
        self.stop.set()
        bytes_up, bytes_down = self.transport.stats.totals()
        summary = {
            "peer_id": self.id, "address": self.transport.address, "algorithm": self.cfg.algorithm,
            "partition_id": self.cfg.partition_id, "rounds_done": self.round, "restarts": self.restarts,
            "bytes_up": bytes_up, "bytes_down": bytes_down, "bytes_by_kind": self.transport.stats.by_kind(),
            "dropped": self.verifier.drop_counts(), "refused": list(self.transport.refusals),
            "late": self.inbox.late, "wall_s": wall_s,
            "events": [(t, e, p[:8]) for t, e, p in self.membership.events],
            "config": {k: v for k, v in self.cfg.model_dump().items() if k != "token"},
            "rows": self.history,
        }
        if self.recorder is not None:
            self.recorder.finish(summary)
        self._hb.join(timeout=2 * self.cfg.heartbeat_s + 2)
        self.transport.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._publish("result.json", json.dumps(summary, indent=1, default=str))
        log.info("%s: done, dropped %s", self.ident.short_id, summary["dropped"])
        return summary

    def _publish(self, name: str, text: str) -> None:
        """Write ``STATE_DIR/name`` whole or not at all (temp file, then an atomic rename): a
        launcher reading it never sees half a file."""
        tmp = self.dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.dir / name)

    def install_signal_handlers(self) -> None:
        def _term(signum, frame):
            self.stop.set()

        signal.signal(signal.SIGTERM, _term)
        signal.signal(signal.SIGINT, _term)
