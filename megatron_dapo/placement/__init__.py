"""Where the rollout side runs relative to training, as the trainer sees it, in either pipeline.mode: the `Rollout`
protocol and make_rollout, which builds an implementation by mode, ready to serve (protocol.py); which train rank
trains which response (split.py: TrainSplit); evaluation as a request answered through a handle (evaluation.py);
colocated, the engines in the train processes (colocated.py: ColocatedRollout, and build_rollout_parts, the one
function that builds an engine, reward pool, evaluator and loader for both modes); asynchronous, split into two sides:
the train side's end (remote.py: RemoteRollout), the rollout processes' controller and entry point (controller.py)
and where the two sides meet (transport.py; docs/async.md)."""
