"""The run config: one pydantic schema for the CLI, TOML files, the dashboard form and
Flower's ``run_config``.

Unknown keys and out-of-range values are rejected with :class:`ConfigError`, whose
message names the key and what is allowed, so the CLI can print one line and exit 2.
Strategy hyperparameters (``params``) are checked against the strategy's registry entry
by :func:`fedswarm.strategies.registry.resolve_params`.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from pydantic import (BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, ValidationError, WithJsonSchema,
                      field_validator, model_validator)

from fedswarm.algorithms.privacy.dp_spec import DPSpec, parse_dp
from fedswarm.algorithms.robust.attacks import Attack, parse_attack
from fedswarm.errors import ConfigError

__all__ = ["RunConfig", "TrainingSpec", "EngineName", "parse_partition", "load_config", "round_seed"]

#: The simulation engines' names, the values of :attr:`RunConfig.engine`. Each is one entry of
#: ``fedswarm.sim.engines.ENGINES`` (what it runs, its help, its check), which refuses to load unless
#: its names are these, in this order: the run config sits below the engines and cannot import them.
EngineName = Literal["inprocess", "flower", "array", "batched", "clock"]


def round_seed(seed: int, server_round: int, partition_id: int) -> int:
    """The seed of one node's local training in one round: fedswarm's one recipe, the same
    on every runtime (Flower's ClientApp, the simulators, the swarm's peers) and engine."""
    return (seed * 1_000_003 + server_round * 10_007 + partition_id) % (2**31 - 1)


_PARTITION_RE = re.compile(
    r"^(iid|dirichlet:(?P<alpha>[0-9.eE+-]+)|shards:(?P<k>[0-9]+)|dominant:(?P<p>[0-9.eE+-]+))$")


def parse_partition(spec: str) -> tuple[str, float | int | None]:
    """``iid`` -> ("iid", None); ``dirichlet:0.5`` -> ("dirichlet", 0.5);
    ``shards:2`` -> ("shards", 2); ``dominant:0.8`` -> ("dominant", 0.8)."""
    m = _PARTITION_RE.match(spec.strip())
    if not m:
        raise ValueError("must be 'iid', 'dirichlet:ALPHA' (ALPHA > 0), 'shards:K' (K >= 1) "
                         "or 'dominant:P' (0 < P <= 1)")
    if m.group("alpha") is not None:
        alpha = float(m.group("alpha"))
        if not alpha > 0:
            raise ValueError("dirichlet ALPHA must be > 0")
        return "dirichlet", alpha
    if m.group("p") is not None:
        frac = float(m.group("p"))
        if not 0 < frac <= 1:
            raise ValueError(f"dominant P is the fraction of a client's examples from its own class: "
                             f"it must be in (0, 1], got {frac}")
        return "dominant", frac
    if m.group("k") is not None:
        k = int(m.group("k"))
        if k < 1:
            raise ValueError("shards K must be >= 1")
        return "shards", k
    return "iid", None


# The fields every runtime's config shares, typed once: TrainingSpec declares them, and a
# config that needs another default (the swarm's) redeclares only the default.
Task = Annotated[str, Field(description="Model + data: a built-in task name (see `fedswarm strategies`) "
                                        "or 'module:function'.")]
Params = Annotated[dict[str, Any], Field(description="Algorithm hyperparameters (`--set key=value`).")]
Rounds = Annotated[int, Field(ge=1, le=1_000_000, description="Number of rounds.")]
Partition = Annotated[str, Field(description="How data is split: 'iid', 'dirichlet:ALPHA', 'shards:K' or "
                                             "'dominant:P'.")]
LocalSteps = Annotated[int, Field(ge=1, le=1_000_000, description="Local SGD steps per round.")]
BatchSize = Annotated[int, Field(ge=1, le=1_000_000, description="Local minibatch size.")]
LearningRate = Annotated[float, Field(gt=0.0, le=100.0, description="Client learning rate.")]
Seed = Annotated[int, Field(ge=0, le=2**31 - 1, description="Seed for model init, data split and sampling.")]
Topology = Annotated[str, Field(description="Gossip topology for decentralized strategies: ring, torus, exp, "
                                            "onepeer-exp, complete, random:D, edges:PATH.")]
TorchDevice = Annotated[str, Field(description="Torch device for training: 'cpu', 'cuda', 'cuda:N', 'mps' "
                                               "or 'auto'.")]


def _attack(v: Any) -> Attack | None:
    if v is None or isinstance(v, Attack):
        return v
    return parse_attack(v)


def _dp_spec(what: str):
    def parse(v: Any) -> DPSpec | None:
        if v is None or isinstance(v, DPSpec):
            spec = v
        else:
            spec = parse_dp(v, what)
        if spec is not None and what == "dp_sgd" and spec.noise_multiplier is None:
            raise ValueError("--dp-sgd needs noise_multiplier=N (target_epsilon=E then stops the run at that budget)")
        return spec

    return parse


_TEXT_OR_NULL = WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "null"}]})

#: ``--attack``, parsed once when the config is built: an :class:`~fedswarm.algorithms.robust.attacks.Attack`
#: in the config, its spec string (``signflip:scale=1.0``) in a dump, the store and ``result.json``.
AttackField = Annotated[Attack | None, PlainValidator(_attack),
                        PlainSerializer(lambda a: None if a is None else a.spec, return_type=str | None),
                        _TEXT_OR_NULL]
#: ``--dp`` / ``--dp-sgd``, parsed once: a :class:`~fedswarm.algorithms.privacy.dp_fedavg.DPSpec`
#: in the config, its normalized text (``noise_multiplier=1.0,clip=1.0,...``) when dumped.
DPField = Annotated[DPSpec | None, PlainValidator(_dp_spec("dp")),
                    PlainSerializer(lambda s: None if s is None else s.text(), return_type=str | None), _TEXT_OR_NULL]
DPSGDField = Annotated[DPSpec | None, PlainValidator(_dp_spec("dp_sgd")),
                       PlainSerializer(lambda s: None if s is None else s.text(), return_type=str | None),
                       _TEXT_OR_NULL]


class TrainingSpec(BaseModel):
    """What every runtime's config shares: the task and its split, the seed, the rounds and
    the local SGD. :class:`RunConfig` (the simulators and Flower), the swarm's ``PeerConfig``
    and its launcher's ``SwarmSpec`` are built on it, so these fields are declared and
    checked in one place."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    task: Task = "digits-mlp"
    params: Params = Field(default_factory=dict)
    rounds: Rounds = 10
    partition: Partition = "iid"
    local_steps: LocalSteps | None = Field(
        None, description="Local SGD steps per round (overrides local_epochs when set).")
    batch_size: BatchSize = 16
    lr: LearningRate = 0.3
    seed: Seed = 0
    topology: Topology = "ring"
    device: TorchDevice = "cpu"

    @field_validator("partition")
    @classmethod
    def _check_partition(cls, v: str) -> str:
        parse_partition(v)
        return v.strip()

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if not re.match(r"^(cpu|auto|mps|cuda(:[0-9]+)?)$", v):
            raise ValueError("must be 'cpu', 'auto', 'mps', 'cuda' or 'cuda:N'")
        return v


class RunConfig(TrainingSpec):
    """Everything that defines a run. Same seed and config give the same model."""

    name: str | None = Field(None, description="A label for the run in the store and dashboard.")
    strategy: str = Field("fedavg", description="A registered strategy name.")
    clients: int = Field(20, ge=1, le=1_000_000, description="Number of clients (partitions).")
    fraction: float = Field(
        1.0, gt=0.0, le=1.0, description="Fraction of clients sampled each round."
    )
    local_epochs: int = Field(2, ge=1, le=10_000, description="Local epochs per round.")
    momentum: float = Field(0.0, ge=0.0, lt=1.0, description="Client SGD momentum.")
    engine: EngineName = Field(
        "inprocess", description="The simulation engine (`fedswarm sim --help` says what each runs): 'inprocess' "
        "(no Ray, default), 'flower' (Flower's Simulation Engine), 'array' (decentralized algorithms on [n, d] "
        "tensors), 'batched' (all sampled clients trained at once with torch.func.vmap) or 'clock' (asynchronous "
        "algorithms on the virtual clock)."
    )
    memory_budget: str | None = Field(
        None, description="--engine batched: memory for one chunk of clients, e.g. '2GB' (default: a quarter "
        "of free RAM, at most 8 GB, or half of free GPU memory)."
    )
    ray_address: str | None = Field(
        None, description="--engine flower: attach to this running Ray cluster (e.g. '127.0.0.1:6379') "
        "instead of starting one; --engine batched: train each round's cohort on Ray actors of that cluster."
    )
    workers: int | None = Field(
        None, ge=1, le=1024, description="--engine batched with --ray-address: the Ray actors a round's cohort "
        "is split across, each client always on the same one (default 2)."
    )
    test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="Share of the task's data held out as the global test set."
    )
    devices: str | None = Field(
        None, description="Device classes of the nodes for the time model, e.g. 'gpu:4,edge-wifi:12' "
                          "(see fedswarm/timemodel.py)."
    )
    profiles: str | None = Field(None, description="A TOML file of device/link profiles merged over the built-in ones.")
    policies: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Per-device-class policies, e.g. {'edge-lte': {'local_steps': 2}} (see fedswarm/policy.py).",
    )
    byzantine: int = Field(0, ge=0, le=1_000_000, description=(
        "Number of Byzantine clients (chosen with the seed); their replies are rewritten by --attack and never "
        "flagged to the aggregator."))
    attack: AttackField = Field(None, description=(
        "What Byzantine clients do: NAME[:key=value,...], NAME one of signflip, gaussian, alie, ipm, signvote, "
        "labelflip, random (default signflip when byzantine > 0)."))
    dp: DPField = Field(None, description=(
        "Client-level DP-FedAvg: 'noise_multiplier=N[,clip=C,delta=D,adaptive=true]' or "
        "'target_epsilon=E[,delta=D]'. With secagg: distributed DP on the nodes, 'noise_multiplier=N' "
        "and optionally ',clip=C', ',delta=D', ',mechanism=dgauss|skellam' (the nodes' integer noise), "
        "',secure=true' (noise from the OS, not the seed)."))
    dp_sgd: DPSGDField = Field(None, description=(
        "Example-level DP-SGD in every client (opacus): 'noise_multiplier=N[,clip=C,delta=D,target_epsilon=E]'."))
    client_data: str | None = Field(None, description=(
        "A folder with one dataset per client (sorted by name): each client trains on its own data instead of a "
        "partition (see docs/devices.md for the formats)."))
    label_column: str | None = Field(None, description=(
        "With client_data: the label column of CSV, Parquet and Hugging Face datasets (default 'label')."))
    val_fraction: float | None = Field(None, ge=0.0, lt=1.0, description=(
        "With client_data: share of each client's examples held out as its local validation split (default 0.2)."))
    checkpoint_every: int = Field(1, ge=1, le=1_000_000, description=(
        "Checkpoint the server every K rounds (and when a control changes the run); a resume redoes the rounds "
        "after the newest checkpoint, at most K - 1."))
    # Left out of the run's flat config at their defaults (QUIET_DEFAULTS), so runs that do not use them
    # send the nodes what they sent before.
    eval_every: int = Field(1, ge=1, le=1_000_000, description=(
        "Federated evaluation every K rounds: the round's cohort scores the model on its own validation split; "
        "recorded as fed_loss, fed_accuracy, fed_examples."))
    central_eval: bool = Field(True, description=(
        "false: the server holds no test set and evaluates nothing itself (only federated evaluation)."))
    round_timeout: float = Field(600.0, gt=0.0, le=86_400.0, description=(
        "Seconds a round waits for the nodes' replies before it goes on without the missing ones."))
    # Fleets of devices that sleep (fedswarm.server.fleet_grid, docs/devices.md); quiet at their defaults.
    quorum: int | None = Field(None, ge=1, le=1_000_000, description=(
        "Close a federated round once K replies are in; later replies are discarded and recorded as 'late' "
        "(default with over_select: the nodes the strategy needs)."))
    over_select: float = Field(1.0, ge=1.0, le=100.0, description=(
        "Sample F times the nodes the strategy needs each round (with quorum: the round closes on the first K)."))
    eligible: str | None = Field(None, description=(
        "Eligibility rules on the nodes' telemetry, e.g. 'battery>=40,charging,temp<45' (docs/devices.md "
        "section 7); a node failing them is not sampled and its row says why."))
    availability: str | None = Field(None, description=(
        "Simulated availability: 'on=S,off=S[,diurnal=A,period=S,dropout=P]' (or CLASS:...;CLASS:...) or a "
        "trace CSV 'node,start_s,end_s' (docs/devices.md section 7); needs devices (simulated time)."))
    secagg: bool = Field(False, description=(
        "Secure aggregation (SecAgg+, docs/secagg.md): the server learns only the sum of the nodes' quantized "
        "updates; for strategies whose registry entry says secagg."))
    secagg_threshold: float = Field(0.6, gt=0.5, le=1_000_000, description=(
        "SecAgg+ share threshold t: a fraction of a node's neighbourhood in (0.5, 1], or a count >= 2; up to "
        "(neighbourhood - t) nodes may drop after sharing."))
    secagg_clip: float = Field(1.0, gt=0.0, le=1e6, description=(
        "SecAgg+: each coordinate of a node's update (its model change) is clipped to [-clip, clip] before "
        "quantization."))
    secagg_bits: int = Field(32, ge=8, le=64, description=(
        "SecAgg+ field bits b (arithmetic mod 2^b); the quantization levels are the most that cannot wrap "
        "(docs/secagg.md)."))
    secagg_dropout: float = Field(0.0, ge=0.0, lt=1.0, description=(
        "SecAgg+: simulated dropout, the probability that a node vanishes at one stage (both drawn from the "
        "seed and round), its replies from there on lost; the same nodes on every engine."))

    @field_validator("policies")
    @classmethod
    def _check_policies(cls, v: dict) -> dict:
        from fedswarm.policy import PolicyBook

        try:
            return PolicyBook(v).as_dict()
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="before")
    @classmethod
    def _default_attack(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("byzantine") and not values.get("attack"):
            values = {**values, "attack": "signflip"}
        return values

    @model_validator(mode="after")
    def _check_byzantine(self) -> "RunConfig":
        if self.byzantine > self.clients:
            raise ValueError(f"byzantine: {self.byzantine} Byzantine clients asked for, "
                             f"the run has {self.clients} clients")
        if self.attack is not None and self.byzantine == 0:
            raise ValueError("attack: an attack needs Byzantine clients (--byzantine K)")
        return self

    @model_validator(mode="after")
    def _check_secagg(self) -> "RunConfig":
        if self.secagg_dropout and not self.secagg:
            raise ValueError("secagg_dropout: simulated secure-aggregation dropouts need secagg = true (--secagg)")
        if self.secagg_threshold > 1 and self.secagg_threshold != int(self.secagg_threshold):
            raise ValueError(f"secagg_threshold: a count must be a whole number, got {self.secagg_threshold}")
        return self

    @model_validator(mode="after")
    def _check_devices(self) -> "RunConfig":
        if self.devices is not None:
            from fedswarm.timemodel import load_profiles, parse_devices

            try:
                profiles = load_profiles(self.profiles) if self.profiles else None
                parse_devices(self.devices, self.clients, profiles)
            except (ValueError, OSError) as exc:
                raise ValueError(f"devices: {exc}") from None
        return self

    @field_validator("quorum", "eligible", "availability", mode="before")
    @classmethod
    def _unset(cls, v: Any) -> Any:
        return None if v in ("", 0) and not isinstance(v, bool) else v  # Flower's run_config has no null

    @model_validator(mode="after")
    def _check_fleet(self) -> "RunConfig":
        if self.quorum is not None and self.quorum > self.clients:
            raise ValueError(f"quorum: {self.quorum} replies asked for, the run has {self.clients} clients")
        share = min(1.0, self.fraction * self.over_select)  # what a round samples with every node on
        if self.quorum is not None and self.quorum > max(int(self.clients * share), 1) and self.strategy != "fedbuff":
            raise ValueError(f"quorum: {self.quorum} replies asked for, a round samples only "
                             f"{max(int(self.clients * share), 1)} of the {self.clients} clients (fraction "
                             f"{self.fraction:g} x over_select {self.over_select:g}): ask for at most that many, "
                             "or raise --fraction or --over-select")
        if self.over_select > 1.0 and self.fraction >= 1.0 and self.strategy != "fedbuff":  # fedbuff refuses it
            raise ValueError(f"over_select: {self.over_select:g} samples no more nodes at fraction 1 (every node is "
                             f"sampled already): give --fraction below 1/F, e.g. --fraction "
                             f"{math.floor(100 / self.over_select) / 100:g}")
        if self.eligible is not None:
            from fedswarm.eligibility import parse_rules

            try:
                parse_rules(self.eligible)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        if self.availability is not None:
            from fedswarm.availability import check_classes, is_trace, parse_process

            if self.devices is None:
                raise ValueError("availability: simulated availability runs on simulated time: give --devices too")
            try:
                if is_trace(self.availability):
                    _check_trace(self.availability, self.clients)
                elif set(per_class := parse_process(self.availability)) - {"*"}:  # classes named: in --devices?
                    from fedswarm.timemodel import load_profiles, parse_devices

                    profiles = load_profiles(self.profiles) if self.profiles else None
                    check_classes(per_class, parse_devices(self.devices, self.clients, profiles))
            except ConfigError as exc:
                msg = str(exc)  # a trace's refusal names the file, not the key
                raise ValueError(msg if msg.startswith("availability:") else f"availability: {msg}") from None
        return self

    def fleet_options(self) -> list[str]:
        """The fleet options this run uses (quorum, over-selection, eligibility, availability:
        ``fedswarm.server.fleet_grid``), as their flags."""
        used = [("--quorum", self.quorum is not None), ("--over-select", self.over_select > 1.0),
                ("--eligible", self.eligible is not None or any("eligible" in p for p in self.policies.values())),
                ("--availability", self.availability is not None)]
        return [flag for flag, on in used if on]

    @classmethod
    def build(cls, values: dict[str, Any]) -> "RunConfig":
        """Validate ``values``; raise :class:`ConfigError` with one clear line on failure."""
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc)) from None

    @classmethod
    def allowed_keys(cls) -> list[str]:
        return list(cls.model_fields)

    def to_flat(self) -> dict[str, Any]:
        """The config as a flat dict of scalars (Flower's ``run_config`` needs scalars):
        strategy params become ``params.KEY``."""
        out: dict[str, Any] = {}
        for k, v in self.model_dump().items():
            if k in QUIET_DEFAULTS and v == QUIET_DEFAULTS[k]:
                continue
            if k == "params":
                out.update({f"params.{pk}": pv for pk, pv in v.items()})
            elif k == "policies":
                if v:
                    out[k] = json.dumps(v, sort_keys=True)
            elif v is not None:
                out[k] = v
        return out

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> "RunConfig":
        values: dict[str, Any] = {}
        params: dict[str, Any] = {}
        for k, v in flat.items():
            if k == "policies" and isinstance(v, str):
                values[k] = json.loads(v) if v else {}
            elif k == "params" and isinstance(v, str):  # a deployment's run config: the strategy's params as JSON
                params.update(json.loads(v) if v.strip() else {})
            elif k.startswith("params."):
                params[k[len("params.") :]] = v
            else:
                values[k] = v
        if params:
            values["params"] = params
        return cls.build(values)


def _check_trace(path: str, clients: int) -> None:
    """Check an availability trace (:func:`fedswarm.availability.load_trace`) once per version of
    the file: every node's message validates the run config again (``run_config_of``), and a
    trace may have tens of thousands of lines."""
    try:
        st = Path(path).stat()
    except OSError:
        st = None  # load_trace refuses it, naming the file
    version = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size) if st is not None else None
    _check_trace_version(path, clients, version)


@functools.lru_cache(maxsize=16)
def _check_trace_version(path: str, clients: int, version: tuple[int, int, int, int] | None) -> None:
    from fedswarm.availability import load_trace

    load_trace(path, clients)  # a refusal raises, and lru_cache keeps no exception


#: Keys :meth:`RunConfig.to_flat` leaves out at these (their default) values: added after runs and
#: byte counts were recorded, they change nothing in what an unchanged run sends.
QUIET_DEFAULTS = {"eval_every": 1, "central_eval": True, "round_timeout": 600.0, "over_select": 1.0,
                  "secagg": False, "secagg_threshold": 0.6, "secagg_clip": 1.0, "secagg_bits": 32,
                  "secagg_dropout": 0.0}


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem, naming the key and what is allowed."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "config"
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(RunConfig.allowed_keys())
            lines.append(f"unknown key '{key}' (allowed keys: {allowed})")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if not err["loc"] and ": " in msg and msg.split(": ", 1)[0] in RunConfig.model_fields:
            key, msg = msg.split(": ", 1)  # a check across fields names its own key
        field = RunConfig.model_fields.get(key.split(".")[0])
        got = err.get("input")
        if isinstance(got, dict) and key in got:
            got = got[key]
        hint = f" [{field.description}]" if field is not None and field.description else ""
        lines.append(f"invalid value for '{key}': {msg} (got {got!r}){hint}")
    return "; ".join(lines)


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a TOML run config; a ``[params]`` table holds strategy hyperparameters."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file '{p}' is not valid TOML: {exc}") from None
