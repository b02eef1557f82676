"""Engines run branches: the ``Engine`` protocol (:mod:`.base`) and its implementations.

The package imports nothing itself: a llama.cpp worker process imports the modules it
needs from here (``base``, ``sampling``, ``stops``) and must not pull in the gateway's
side (the engine table, supervisors, the registry, pydantic), whose memory would count
in every branch's measured footprint. Import what you use from its module.
"""
