"""Put on PYTHONPATH by test_data_parallel_ranks.py: in learner rank 1 of `masgraph train --learners 2`, the Flow-GRPO
optimizer step number STALL_AT (default 2: step 2's, with one mini-batch per update) writes this process's pid to
STALL_DIR/stalled and then waits there (for the test's SIGKILL) while rank 0 waits in the step's first collective.
Nothing happens in other processes."""

import os

if os.environ.get("RANK") == "1" and os.environ.get("STALL_DIR"):
    import time

    from masgraph.trainers.flow_grpo import FlowGRPO

    _step = FlowGRPO._optimizer_step
    _calls = [0]

    def _stalled(self, *args, **kw):
        _calls[0] += 1
        if _calls[0] == int(os.environ.get("STALL_AT", "2")):
            with open(os.path.join(os.environ["STALL_DIR"], "stalled"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)
        return _step(self, *args, **kw)

    FlowGRPO._optimizer_step = _stalled
