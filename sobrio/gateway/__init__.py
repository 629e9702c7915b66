"""The gateway in front of the engines (issue 15): tenants and keys (`tenants.py`, `sobrio admin`); the
router, ledger, energy accounting and backends come next."""
