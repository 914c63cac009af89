"""The learning side of masgraph: the learner that owns trainable adapters, what serves them to a training run,
and how training shapes its rollouts (branching, counterfactual scoring). The runtime imports nothing from here;
trainers (`masgraph.trainers`) do."""
