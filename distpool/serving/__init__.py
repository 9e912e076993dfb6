"""Serving: the deployment on Ray, routing, the PD driver, workloads, parity, the report, the run."""
