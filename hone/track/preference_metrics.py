"""The names preference objectives log their metrics under: TRL's, so that a TRL user's
dashboards and habits carry over. One list for the objective that computes them
(:mod:`hone.runtime.pair_loss`) and the trackers that file them (:mod:`hone.track.tensorboard`)."""

#: Logged by every preference objective (means over the window's pairs).
REWARD_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)

#: ORPO's own, beside them (TRL's ``ORPOTrainer``); ``nll_loss`` is the window's NLL, a loss term.
ORPO_METRICS = ("log_odds_ratio", "log_odds_chosen")

#: Every name a preference run's rows may carry (``eval_`` prefixed in eval rows).
PREFERENCE_METRICS = (*REWARD_METRICS, "nll_loss", *ORPO_METRICS)
