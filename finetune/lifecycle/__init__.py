"""The run's lifecycle, the end of the data's way: metrics, checkpoints and what a run leaves behind.

Owns the run folder and its launches (:mod:`.run_folder`), checkpoints and their COMPLETE marker
(:mod:`.checkpoint`), resuming on the same or another layout (:mod:`.resume`), the verified Hugging Face export
(:mod:`.export`) and its model card (:mod:`.model_card`), the health watch of the ranks (:mod:`.health`), signals
and preemption (:mod:`.preemption`) and the run report (:mod:`.report`). It may import the engine, the recipes,
the data pipeline, the parallel layout and the base (config, logs, errors); the training loop and the commands
import it.
"""
