"""Crossing the air gap: what users carry to a cluster with no internet, and how it is checked there.

Owns the offline bundle (:mod:`.bundle`: wheels, model, tokenizer and data packed with their hashes, unpacked
without running code from it) and the manifests of model folders (:mod:`.manifest`: weight files, index,
what a model folder must hold). It imports only the base (errors); the commands and the pre-flight checks
import it.
"""
