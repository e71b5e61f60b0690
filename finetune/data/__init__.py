"""The data pipeline, the first half of the data's way: parquet files -> tokens -> batches.

Owns reading and splitting the parquet files (:mod:`.dataset`: splits, samplers, the row-seeded collate), the
tokenization cache (:mod:`.tokenization`), weighted mixtures of sources (:mod:`.mixture`) and what a collated
micro-batch holds (:mod:`.batch`). It may import the parallel layout (sequence sharding of batches), the run
config, logging and errors; it never imports the engine, the recipes or the run's lifecycle: a recipe hands it
an ``encode``/``collate`` pair, and it hands the loop batches.
"""
