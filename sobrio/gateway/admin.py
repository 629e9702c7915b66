"""`sobrio admin tenants create|list|delete` and `sobrio admin keys create|list|revoke`: the tenants and keys
the gateway checks (gateway/tenants.py), in the database `sobrio serve` reads by default."""

import argparse
import dataclasses
import time

from sobrio.gateway.tenants import Limits, TenantError, TenantStore, default_db_path


def add_admin_parser(sub) -> None:
    admin = sub.add_parser("admin", help="manage the gateway's tenants and API keys (an embedded SQLite file)")
    admin.add_argument("--db", default=None, help=f"the database (default: $SOBRIO_DB or {default_db_path()})")
    objects = admin.add_subparsers(dest="object", required=True)
    tenants = objects.add_parser("tenants", help="create, list or delete tenants").add_subparsers(
        dest="action", required=True)
    for action, text in (("create", "a new tenant (its limits optional)"),
                         ("set-limits", "change the limits given (the others stay; --clear removes one); the "
                                        "running server applies them to its next request")):
        parser = tenants.add_parser(action, help=text)
        parser.add_argument("name", help="1-64 letters, digits, '.', '_' or '-'")
        _add_limit_args(parser)
        if action == "set-limits":
            parser.add_argument("--clear", nargs="+", default=[], choices=list(LIMIT_FLAGS), metavar="LIMIT",
                                help="limits to remove (no limit from then on): " + ", ".join(LIMIT_FLAGS))
    tenants.add_parser("list", help="every tenant and its limits")
    tenants.add_parser("delete", help="a tenant and all its keys").add_argument("name", help="the tenant")
    keys = objects.add_parser("keys", help="create, list or revoke API keys").add_subparsers(
        dest="action", required=True)
    keys.add_parser("create", help="a new key, printed once").add_argument("--tenant", required=True,
                                                                          help="the tenant's name")
    keys.add_parser("list", help="key ids, tenants, dates (never the keys)").add_argument(
        "--tenant", default=None, help="only this tenant's (default: every tenant's)")
    keys.add_parser("revoke", help="a key, by its id").add_argument("key_id", help="as `keys list` shows it")
    admin.set_defaults(func=cmd_admin)


# set-limits --clear's names: the flag of each limit, and its field in Limits
LIMIT_FLAGS = {"requests-per-minute": "requests_per_minute", "tokens-per-day": "tokens_per_day",
               "max-concurrent": "max_concurrent", "models": "allowed_models", "regions": "allowed_regions",
               "default-model": "default_model", "kv-offload": "kv_offload"}


def _add_limit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests-per-minute", type=int, default=None, help="(default: no limit)")
    parser.add_argument("--tokens-per-day", type=int, default=None,
                        help="prompt and completion tokens, from midnight UTC (default: no limit)")
    parser.add_argument("--max-concurrent", type=int, default=None,
                        help="requests in flight at once (default: no limit)")
    parser.add_argument("--models", default=None, help="comma-separated models it may use (default: all)")
    parser.add_argument("--regions", default=None, help="comma-separated regions that may serve it: ISO 3166 "
                                                       "alpha-3 codes (ITA, FRA, ...) or EU (default: all)")
    parser.add_argument("--default-model", default=None, help='the model of its requests that name none ("auto": '
                                                              "the router's choice; default: the server's first)")
    parser.add_argument("--kv-offload", action=argparse.BooleanOptionalAction, default=None,
                        help="its KV blocks may go to the server's offload tiers, disk included, encrypted under "
                             "its own key (default: no; Zero Data Retention keeps its KV in the pool only)")


def cmd_admin(args: argparse.Namespace) -> int:
    store = TenantStore(args.db)
    try:
        ACTIONS[(args.object, args.action)](store, args)
    finally:
        store.close()
    return 0


def _limits(args: argparse.Namespace) -> Limits:
    return Limits(args.requests_per_minute, args.tokens_per_day, args.max_concurrent, _names(args.models),
                  _names(args.regions), args.default_model, args.kv_offload)


def _create_tenant(store: TenantStore, args: argparse.Namespace) -> None:
    tenant = store.create_tenant(args.name, _limits(args))
    print(f"created tenant {tenant.name} (id {tenant.id})")


def _set_limits(store: TenantStore, args: argparse.Namespace) -> None:
    """Only what is given changes: an operator tightening one limit must not lose the others."""
    given = {name: value for name, value in dataclasses.asdict(_limits(args)).items() if value is not None}
    cleared = {LIMIT_FLAGS[flag]: None for flag in args.clear}
    both = set(given) & set(cleared)
    if both:
        raise TenantError(f"both set and cleared: {', '.join(sorted(both))}")
    store.set_limits(args.name, dataclasses.replace(store.tenant(args.name).limits, **given, **cleared))
    print(f"new limits for tenant {args.name}")


def _list_tenants(store: TenantStore, args: argparse.Namespace) -> None:
    for t in store.tenants():
        lim = t.limits
        print(f"{t.name}\tid={t.id}\tcreated={_date(t.created_at)}\trpm={lim.requests_per_minute or '-'}\t"
              f"tokens/day={lim.tokens_per_day or '-'}\tconcurrent={lim.max_concurrent or '-'}\t"
              f"models={','.join(lim.allowed_models or ('*',))}\tregions={','.join(lim.allowed_regions or ('*',))}"
              f"\tdefault-model={lim.default_model or '-'}\tkv-offload={'yes' if lim.kv_offload else 'no'}")


def _delete_tenant(store: TenantStore, args: argparse.Namespace) -> None:
    store.delete_tenant(args.name)
    print(f"deleted tenant {args.name} and its keys")


def _create_key(store: TenantStore, args: argparse.Namespace) -> None:
    key, text = store.create_key(args.tenant)
    print(text)
    print(f"key {key.key_id} of tenant {key.tenant}: shown this once, stored only as a keyed hash")


def _list_keys(store: TenantStore, args: argparse.Namespace) -> None:
    for k in store.keys(args.tenant):
        state = "active" if k.revoked_at is None else f"revoked {_date(k.revoked_at)}"
        print(f"{k.key_id}\t{k.tenant}\tcreated={_date(k.created_at)}\t{state}")


def _revoke_key(store: TenantStore, args: argparse.Namespace) -> None:
    store.revoke_key(args.key_id)
    print(f"revoked key {args.key_id}")


ACTIONS = {("tenants", "create"): _create_tenant, ("tenants", "set-limits"): _set_limits,
           ("tenants", "list"): _list_tenants, ("tenants", "delete"): _delete_tenant,
           ("keys", "create"): _create_key, ("keys", "list"): _list_keys, ("keys", "revoke"): _revoke_key}


def _names(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(n.strip() for n in text.split(",") if n.strip())


def _date(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
