"""RL trainers for masgraph graphs; installed as masgraph.trainers."""

if __name__ != "masgraph.trainers":  # the repo root is on sys.path (e.g. `python` started there)
    raise ImportError("this directory installs as `masgraph.trainers`; import that name instead of `trainers`")
