"""Stage 3: RL from branch groups, one concern per module.

- ``scoring``: a trajectory's score from the privileged checks; a group's advantages and verdict;
- ``samples``: a group as step records; ``RLFeaturize`` (a step -> a sample with its advantage and the
  behaviour log-probs);
- ``stream``: the learner's grain source over a growing set of group shards (exact state, DPO pairs,
  staleness bound); ``order``: the one order of the shards that all the learner's hosts follow;
- ``loss``: ``L_post`` on a mixed batch from ``losses.rl``'s pure pieces;
- ``learner``: the RL ``Stage`` of the shared train loop, its mixed batches and the frozen reference;
- ``weights``: the actors' policy server following the learner's checkpoints;
- ``actors``: branch groups on the game fleet, written whole or not at all;
- ``spec``: the options (``RLSpec``); ``driver``: learner process + actors + evaluation on one machine;
- ``plan``: the AOT plan of the RL step on a pod.
"""
