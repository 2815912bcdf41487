"""Measurements that run a model and write data for methods and reports, never imported by them:

* ``capture``: attention rows / queries and keys of sample texts (no cache, no method);
* ``pod_grouping``: POD's offline layer grouping (block map JSON, calibrated gate offsets) for ``method=pod``;
* ``layer_similarity``: OmniKV's inter-layer attention similarity, the JSON ``python -m kvbench.report figures`` draws.

Methods read a block map by path (``method.block_map``); the report reads ``<results>/analysis/*.json``.
"""
