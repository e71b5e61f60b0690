"""The training loop: one loop for every recipe, from batches to engine steps, evaluations and metrics.

Owns :func:`.trainer.fit` (steps, gradient accumulation, evaluation, early stopping, keep-best, saving) and
generation during evaluation and at the end of a run (:mod:`.generation`). It may import everything below it
(the lifecycle, the recipes, the engine, the data pipeline, the parallel layout and the base); only the commands
import it.
"""
