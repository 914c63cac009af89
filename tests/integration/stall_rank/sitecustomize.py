"""Put on PYTHONPATH by test_data_parallel_ranks.py: in learner rank 1 of `masgraph train --learners 2`, the gradient
all-reduce number STALL_AT (default 2: step 2's, with one optimizer step per update) writes this process's pid to
STALL_DIR/stalled and then waits there (for the test's SIGKILL). Nothing happens in other processes."""

import os

if os.environ.get("RANK") == "1" and os.environ.get("STALL_DIR"):
    import time

    from masgraph.learn.data_parallel import DataParallel

    _reduce = DataParallel.all_reduce_grads
    _calls = [0]

    def _stalled(self, *args, **kw):
        _calls[0] += 1
        if _calls[0] == int(os.environ.get("STALL_AT", "2")):
            with open(os.path.join(os.environ["STALL_DIR"], "stalled"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)
        return _reduce(self, *args, **kw)

    DataParallel.all_reduce_grads = _stalled
