"""What `masgraph train --learners N` runs outside torchrun: torchrun's own launcher (`torch.distributed.run`),
quiet about how the ranks ended.

Each rank says what went wrong in its own `error:` line (a lost rank names the last checkpoint:
`masgraph.cli.learners`); torchrun's agent would then add its log lines and a `ChildFailedError` traceback. Here a
rank killed by a signal gets one line (it could say nothing itself) and makes the exit code 1, whatever the other
ranks exited with (a rank that saw it go exits 2 with its own error line, or is stopped first: timing decides which,
so it must not decide the code); otherwise a failed rank's own exit code is the launcher's (2: bad input).

    python -m masgraph.cli.launch --standalone --nproc-per-node 2 -m masgraph train graph.yaml ...
"""

from __future__ import annotations

import logging
import signal
import sys


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in list(logging.root.manager.loggerDict):  # the agent's own loggers (each has its level set)
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        codes = {rank: failure.exitcode for rank, failure in sorted(exc.failures.items())}
        killed = {rank: -code for rank, code in codes.items() if code < 0 and code != -signal.SIGTERM}
        for rank, number in killed.items():  # it printed nothing (SIGTERM: torchrun stopping it)
            print(f"error: learner rank {rank} was killed ({_signal_name(number)}); the other ranks were stopped",
                  file=sys.stderr)
        if killed:
            return 1
        return next((code for code in codes.values() if code > 0), 1)  # a rank's own error code (2: bad input)
    except SignalException as exc:  # the launcher itself was told to stop (Ctrl-C, SIGTERM): the ranks were too
        return 128 + int(exc.sigval)
    return 0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
