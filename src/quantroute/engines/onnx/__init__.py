"""ONNX Runtime branches: an exported decoder folder's layout (:mod:`.layout`), the
graph the export writes into it (:mod:`.decoder_graph`, export time only), and the
worker's model over it (:mod:`.worker_model`).

Like :mod:`quantroute.engines`, the package imports nothing itself: a worker
imports the modules it needs.
"""
