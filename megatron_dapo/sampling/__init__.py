"""Dynamic sampling, the heart of DAPO's rollout: the scheduler that decides which prompt groups to generate and
which to accept (scheduler.py, its state scheduler_state.py, step.py, records.py), the loader that drives engines
and the reward pool with it (loader.py), group summaries and the informative test's inputs (group_summary.py),
prompt memory (prompt_memory.py), the exchange of rollout data between ranks (exchange.py), and the paper-scale
simulator with the step-time model (sim/)."""
