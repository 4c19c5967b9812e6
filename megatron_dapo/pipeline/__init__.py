"""The rollout side as the trainer sees it, in either pipeline.mode: the `Rollout` protocol and its two
implementations (rollout.py: colocated, the engines in the train processes; remote.py: the train side's end of the
asynchronous rollout processes), the one function that builds an engine, reward pool, held-out evaluator and loader
for both (rollout.py: build_rollout_parts), the asynchronous rollout processes' controller and entry point
(controller.py) and where the two sides meet (transport.py; docs/async.md)."""
