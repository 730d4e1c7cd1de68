"""The chat workload the serving and cluster benchmarks replay: a seeded, ShareGPT-like
trace of sessions that arrive as a Poisson process, each a document-sized first message
and a few shorter turns with exponential think time between them (log-normal lengths),
and the player that runs each session on its own thread from its arrival time."""

from __future__ import annotations

import argparse
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

WORDS = (  # noqa: SIM905 - a word list reads better as text
    "the river city bridge stone light market winter garden letter music harbor story mountain "
    "engine paper window morning village road forest lantern ship train clock island summer tower "
    "field school friend table doctor number silver painting kitchen history question answer"
).split()


@dataclass
class Turn:
    message: str
    max_new: int


@dataclass
class SessionPlan:
    arrival_s: float
    turns: list[Turn]
    think_s: list[float]


def play(trace: list[SessionPlan], session: Callable[[SessionPlan], None]) -> float:
    """Each session of the trace on its own thread from its arrival time; the wall seconds."""
    t0 = time.perf_counter()

    def arrive(plan: SessionPlan) -> None:
        time.sleep(max(0.0, plan.arrival_s - (time.perf_counter() - t0)))
        session(plan)

    threads = [threading.Thread(target=arrive, args=(p,)) for p in trace]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t0


def make_trace(args: argparse.Namespace) -> list[SessionPlan]:
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for _ in range(args.sessions):
        t += rng.expovariate(args.rate)
        n_turns = rng.randint(args.min_turns, args.max_turns)
        turns = []
        for i in range(n_turns):
            mean = args.doc_words if i == 0 else args.msg_words
            words = max(3, int(rng.lognormvariate(math.log(mean), 0.5)))
            text = " ".join(rng.choice(WORDS) for _ in range(words))
            text = f"Read this and remember it: {text}. What is it about?" if i == 0 else f"{text}?"
            turns.append(Turn(text, max(4, min(args.max_reply, int(rng.lognormvariate(math.log(args.reply), 0.6))))))
        out.append(SessionPlan(t, turns, [rng.expovariate(1 / args.think_s) for _ in turns]))
    return out
