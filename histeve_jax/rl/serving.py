"""Central inference for the actors (SEED RL's split): policy server replicas placed on accelerator hosts
through a Ray resource, games routed to them, weights following the learner, replicas restarted when lost.

``ServerSpec`` is the placement (``config.server``): ``replicas`` ``RLPolicyServer`` actors, each asking for
one unit of the Ray custom resource ``resource`` (a TPU VM or GPU node joins the actors' cluster with
``ray start --resources='{"accelerator": N}'``; "" places them by ``num_cpus`` alone, as on a CPU machine).
``ServerPool`` starts them and is what the actors talk to:

- routing: game i of the fleet asks replica ``i % replicas`` (``RoutedAgentFactory``; the game actor's index
  is ``eval.fleet.game_index()``), so each replica batches the act calls of a fixed set of games, as SEED
  RL's inference servers do;
- weights: ``reload()`` has every replica load the learner's newest checkpoint between waves, and returns
  the oldest step acting (the group's ``policy_step``, what the learner's staleness bound compares);
- failures: a replica whose process or host dies is restarted by Ray (``max_restarts``) on a node that has
  the resource; its constructor loads the start run and then the learner's newest step, so it comes back
  with the newest weights. Calls made to it meanwhile are retried on the restarted replica
  (``max_task_retries=-1``: an act call is a fresh sample either way), so a game waits through the
  restart rather than losing its episode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ray

from histeve_jax.eval.policy_agent import FrameLayout, PolicyAgent


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """Where and how many policy servers run (``config.server``)."""

    resource: str = ""  # Ray custom resource each replica asks one unit of ("": none, CPU placement)
    replicas: int = 1
    num_cpus: float = 0.0  # CPUs each replica reserves besides the resource
    max_batch: int = 0  # rows per compiled act call; 0: the games a replica serves
    max_restarts: int = -1  # Ray restarts of a lost replica (-1: always)

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"config.server.replicas must be >= 1 (got {self.replicas})")
        if self.num_cpus < 0 or self.max_batch < 0:
            raise ValueError(f"config.server.num_cpus and max_batch must be >= 0 (got {self.num_cpus}, "
                             f"{self.max_batch})")

    @classmethod
    def from_config(cls, c: Mapping[str, Any]) -> ServerSpec:
        from histeve_jax.rl.spec import config_fields

        return cls(**config_fields(cls, c, "config.server"))

    def batch_for(self, games: int) -> int:
        """Rows per act call: ``max_batch``, or the games one replica serves."""
        return self.max_batch or -(-games // self.replicas)


@dataclasses.dataclass
class RoutedAgentFactory:
    """``make_agent(task_name, seed)`` for the fleet: game i's agent asks replica ``i % len(servers)``."""

    servers: list[Any]
    layout: FrameLayout
    name: str = "policy"

    def __call__(self, task_name: str, seed: int) -> PolicyAgent:
        from histeve_jax.eval.fleet import game_index

        server = self.servers[game_index() % len(self.servers)]
        return PolicyAgent(server, self.layout, self.name)


class ServerPool:
    """``spec.replicas`` ``RLPolicyServer`` actors of ``start_run`` following ``learner_dir`` (module
    docstring); Ray must be initialised and must offer ``spec.resource``."""

    def __init__(self, spec: ServerSpec, start_run: str, learner_dir: str, *, games: int,
                 temperature: float = 1.0):
        from histeve_jax.rl.weights import RLPolicyServer

        self.spec = spec
        options: dict[str, Any] = {"num_cpus": spec.num_cpus, "max_restarts": spec.max_restarts,
                                   "max_task_retries": -1}
        if spec.resource:
            have = ray.cluster_resources().get(spec.resource, 0.0)
            if have < spec.replicas:
                raise ValueError(
                    f"config.server.resource={spec.resource!r}: the Ray cluster offers {have:g} of it, "
                    f"{spec.replicas} replicas need {spec.replicas}; join the inference hosts with "
                    f"ray start --address=<head>:<port> --resources='{{\"{spec.resource}\": N}}'")
            options["resources"] = {spec.resource: 1}
        actor = ray.remote(RLPolicyServer).options(**options)
        self.servers = [actor.remote(start_run, learner_dir, max_batch=spec.batch_for(games),
                                     temperature=temperature, seed=i) for i in range(spec.replicas)]
        self.layout, _ = ray.get(self.servers[0].layout.remote())

    def factory(self) -> RoutedAgentFactory:
        """The fleet's agent factory (carries the replicas' handles, not the weights)."""
        return RoutedAgentFactory(list(self.servers), self.layout)

    def reload(self) -> int:
        """Every replica loads the learner's newest step; returns the oldest step acting now."""
        return min(int(s) for s in ray.get([s.reload.remote() for s in self.servers]))

    def versions(self) -> list[int]:
        """The learner step each replica acts with."""
        return [int(v) for v in ray.get([s.version.remote() for s in self.servers])]

    def pids(self) -> list[int]:
        """Each replica's worker pid (a restarted replica has a new one)."""
        return [int(p) for p in ray.get([s.pid.remote() for s in self.servers])]

    def nodes(self) -> list[str]:
        """Each replica's Ray node id."""
        return ray.get([s.node_id.remote() for s in self.servers])

    def request_times(self) -> list[list[float]]:
        """Per replica: the arrival times of its act calls since it (last) started."""
        return ray.get([s.request_times.remote() for s in self.servers])

    def close(self) -> None:
        for s in self.servers:
            ray.kill(s, no_restart=True)
        self.servers = []
