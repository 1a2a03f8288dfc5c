"""The HL claim: the paper's learned node selection against random selection.

Arms, all real in-process runs of the ``hl`` strategy (one node trains per round and hands
the model on), side by side in one bench run on the same setting (``bench/edge.py``'s HL
setting: digits-mlp, 10 nodes, the paper's split ``dominant:0.8``: node n holds 80% class n,
target 0.8), with :data:`HOP_EPOCHS` local epochs per hop (the paper's 16 SGD steps a hop):

- ``attention``: the paper's agent (DQN 100→500→200→10 on a PCA of the node models,
  ``fedswarm.algorithms.selection.hl_attention``), trained over its episodes with ε
  decaying to the paper's final value; measured over its last episodes (ε at ~0.09). The
  claim's check is on this arm.
- ``attention+visits``: the same DQN with each node's visit recency in the episode added
  to its state (ours: the paper's state only tells which node trained last).
- ``learned``: the linear Q-function on what the chain reports (the earlier policy), when
  :data:`EPISODES` gives it episodes (off by default: it measured 39% fewer rounds than
  random in the previous quick run and costs as much as a DQN arm).
- ``random``: any node but the one holding the model; every episode measured.
- ``round_robin``: nodes 0, 1, 2, ... in turn (no learning): what visiting every node's class
  in a fixed cycle gives, a reference for what an order can save.

Each episode restarts from the initial model (the paper's agent training) and ends at the
target accuracy or after ``MAX_EPISODE_ROUNDS`` (an unreached episode counts its length,
a lower bound). "Rounds saved" = 1 − mean rounds to target (learned arm) / (random arm).
"""

from __future__ import annotations

import math

from fedswarm.bench.papers.report import Check, Measured
from fedswarm.config import RunConfig
from fedswarm.store import Store

__all__ = ["hl", "EPISODES", "MAX_EPISODE_ROUNDS"]

MAX_EPISODE_ROUNDS = 35  # the paper's cap on an episode's steps
# The paper's hop is one local epoch of a node's 500 images at batch 32: 16 SGD steps. A node
# here holds ~144 examples (digits' 1,437 training images over 10 nodes), so a hop runs 3
# epochs: ~15 steps of batch 32. With one epoch (5 steps) a hop trained so little that any order
# took about as long (full run of 2026-11-26, cap 60: random 37.9 rounds, a round-robin cycle
# 35.8, the paper's DQN 39.3). The other way to the paper's 16 steps, one epoch at batch 9, was
# tried beside it (random and round-robin arms only, cap 35): random 15.4 ± 2.7 rounds, round-robin
# 13.1 ± 2.8 (3 epochs at batch 32: 15.3 ± 2.3 and 11.5 ± 1.6); batch 32 is the paper's.
HOP_EPOCHS = 3
TINY_EPISODE_ROUNDS = 4  # the tiny scale (tests): a few rounds an episode
# episodes per arm, and how many of a learning arm's last episodes are measured
EPISODES = {
    "tiny": {"attention": 2, "learned": 2, "random": 2, "round_robin": 1, "tail": 1},
    "quick": {"attention": 25, "learned": 0, "random": 8, "round_robin": 4, "tail": 8},
    "full": {"attention": 120, "learned": 0, "random": 20, "round_robin": 10, "tail": 20},  # linear Q: 100 if set
}
# The DQN arms: the paper's state (PCA of the node models) and ours with the nodes' visit
# recency added; both train 4 passes of 128 transitions after each episode (the paper: 1
# pass, over 120 episodes; the quick mode has 25).
DQN = {"dqn_passes": 4}
ARMS = (("random", "random", {}),
        ("attention", "attention", {**DQN, "attention_state": "pca"}),
        ("attention+visits", "attention", {**DQN, "attention_state": "pca+visits"}),
        ("learned", "learned", {}),
        ("round-robin", "round_robin", {}))
PAPER_FINAL_EPSILON = math.exp(-0.02 * 120)  # the paper: ε = 1 decayed by exp(-0.02) per episode, 120 episodes


def _arm(store: Store, name: str, selector: str, extra: dict, n_ep: int, tail: int, cap: int = MAX_EPISODE_ROUNDS
         ) -> dict:
    from fedswarm.bench import edge

    params = {"selector": selector, "target_accuracy": edge.HL_TARGET, "max_episode_rounds": cap, **extra}
    if selector in ("attention", "learned"):  # ε reaches the paper's final value at the last episode
        params["epsilon_decay"] = -math.log(PAPER_FINAL_EPSILON) / n_ep
    # checkpoints every 100 hops (and at the stop): nothing here resumes, and a checkpoint of the DQN
    # arms (network, Adam, replay memory: ~2 MB) every hop took about half of each hop's time
    cfg = RunConfig(**{**edge.HL, "local_epochs": HOP_EPOCHS}, strategy="hl", rounds=n_ep * cap, params=params,
                    checkpoint_every=100)
    rid = store.create_run(cfg.model_dump(), name=f"bench-papers-hl-{name}")

    def stop_after(rnd: int, row: dict) -> None:  # stop at the end of the last episode
        ended = row.get("test_accuracy", 0) >= edge.HL_TARGET or row.get("episode_round") == cap
        if row.get("episode") == n_ep and ended:
            store.add_control(rid, "stop", {})

    _, rows = edge._run(cfg, store, [stop_after], rid=rid)
    per: dict[int, list[dict]] = {}
    for r in rows:
        per.setdefault(r["episode"], []).append(r)
    stats = []
    for ep in sorted(per)[:n_ep]:
        er = per[ep]
        hit = next((i for i, r in enumerate(er) if r["test_accuracy"] >= edge.HL_TARGET), None)
        n = hit + 1 if hit is not None else len(er)
        stats.append(dict(rounds=n, bytes=sum(r["bytes_up"] + r["bytes_down"] for r in er[:n]),
                          hop_cost=sum(r["hop_cost"] for r in er[:n]), reached=hit is not None,
                          epsilon=er[0].get("explore_epsilon")))
    use = stats[-tail:] if selector in ("attention", "learned") else stats
    mean = lambda k: sum(s[k] for s in use) / len(use)  # noqa: E731
    sd = math.sqrt(sum((s["rounds"] - mean("rounds")) ** 2 for s in use) / max(1, len(use) - 1))
    return dict(comparison="HL node selection", arm=name, params=params, episodes=len(stats),
                measured_episodes=len(use), reached=f"{sum(s['reached'] for s in use)}/{len(use)}",
                rounds_to_target=mean("rounds"), rounds_std=sd, bytes_to_target=mean("bytes"),
                hop_cost_to_target=mean("hop_cost"), target_acc=edge.HL_TARGET, epsilon_measured=use[0]["epsilon"],
                episode_rounds=[s["rounds"] for s in stats], episode_reached=[s["reached"] for s in stats])


def hl(fl) -> Measured:
    from fedswarm.bench import edge

    ep = EPISODES[fl.s.name]
    cap = TINY_EPISODE_ROUNDS if fl.s.name == "tiny" else MAX_EPISODE_ROUNDS
    rows = [_arm(fl.store, name, sel, extra, ep[sel], ep["tail"], cap) for name, sel, extra in ARMS if ep[sel]]
    by = {r["arm"]: r for r in rows}
    rnd, att, vis = by["random"], by["attention"], by["attention+visits"]
    cut = lambda r: 100 * (1 - r["rounds_to_target"] / rnd["rounds_to_target"])  # noqa: E731
    comm = lambda r: 100 * (1 - r["hop_cost_to_target"] / rnd["hop_cost_to_target"])  # noqa: E731
    for r in rows[1:]:
        r["rounds_saved_pct"], r["hop_cost_saved_pct"] = cut(r), comm(r)
    rate = lambda r: f"{r['rounds_to_target']:.1f} ± {r['rounds_std']:.1f} rounds"  # noqa: E731
    more = f"; linear Q {cut(by['learned']):.0f}%" if "learned" in by else ""
    more += f"; a fixed round-robin cycle {cut(by['round-robin']):.0f}%" if "round-robin" in by else ""
    return Measured(
        ours=(f"the paper's DQN (PCA state) {cut(att):.0f}% fewer rounds than random to {edge.HL_TARGET} ({rate(att)} "
              f"vs {rate(rnd)}); with visit recency added to its state {cut(vis):.0f}% ({rate(vis)}){more}"),
        checks=[Check("rounds saved vs random (the paper's DQN)", cut(att), ">=", 40.0, unit=" %"),
                Check("fewer rounds than random (the paper's DQN)", cut(att), ">", 0.0, direction=True, unit=" %")],
        setting=(f"digits-mlp, {edge.HL['clients']} nodes, {edge.HL['partition']}, {HOP_EPOCHS} epochs per hop "
                 f"(~{HOP_EPOCHS * 5} steps of batch {edge.HL['batch_size']}, lr {edge.HL['lr']}), target "
                 f"{edge.HL_TARGET}, episodes capped at {cap} rounds; DQN arms: "
                 f"{ep['attention']} training episodes, {DQN['dqn_passes']} passes of 128 transitions after each; "
                 + (f"linear Q: {ep['learned']} episodes; " if ep["learned"] else "")
                 + f"ε decayed to the paper's final {PAPER_FINAL_EPSILON:.2f}; learned arms measured over their last "
                 f"{ep['tail']} episodes, random over {ep['random']}"),
        series={r["arm"]: [[i + 1, n] for i, n in enumerate(r["episode_rounds"])] for r in rows},
        xlabel="episode", ylabel="rounds to target", rows=rows,
        note=("The paper's 'self-attention' is its RL agent: in its reference code a DQN on a 10-component PCA "
              "of every node's model weights (here built by the server from the model it sent and the one that "
              "came back: in the chain all node models are equal but the last one's). That state tells the agent "
              "only which node trained last, so a greedy policy is a fixed successor map, which can loop on a few "
              "nodes; 'attention+visits' adds each node's visit recency in the episode to the state (ours, not "
              "the paper's). The linear Q-function (full mode) is the earlier policy." + _order_reference(by)))


def _order_reference(by: dict) -> str:
    """What a fixed cycle through the nodes saves (each node's class visited in turn): a
    reference for what choosing the order can give in this setting."""
    if "round-robin" not in by:
        return ""
    rr, rnd = by["round-robin"], by["random"]
    return (f" A fixed round-robin cycle (every node's class in turn, no learning) takes {rr['rounds_to_target']:.1f} "
            f"± {rr['rounds_std']:.1f} rounds, {rr['rounds_saved_pct']:.0f}% fewer than random; 40% fewer than random "
            f"is {0.6 * rnd['rounds_to_target']:.1f} rounds (the cycle's fastest episode: {min(rr['episode_rounds'])} "
            f"rounds, the fastest of every arm's measured episodes: {_fastest(by)}).")


def _fastest(by: dict) -> int:
    """The fewest rounds to target of any measured episode of any arm."""
    return min(min(r["episode_rounds"][-r["measured_episodes"]:]) for r in by.values())
