"""Accounting: the usage ledger, admission against quotas and budgets, and bills, independent of JupyterHub."""
