"""`jobplane keys` and `jobplane queues`: an admin's commands, API keys made, listed and
revoked, and queues looked at, paused and resumed."""

import argparse

from jobplane.cli.client import APIClient, present, print_pages, segment
from jobplane.cli.render import KEY_HEADER, QUEUE_HEADER, key_row, queue_row
from jobplane.model import ApiKeyPublic


def keys_create(args: argparse.Namespace, client: APIClient) -> None:
    body = {"name": args.name, "role": args.role, "scopes": args.scope}
    key = client.call("POST", "/v1/api-keys", json=body)
    print(f"id:     {key['id']}")
    print(f"name:   {key['name']}")
    print(f"role:   {key['role']}")
    print(f"scopes: {' '.join(key['scopes']) or '(all)'}")
    print(f"secret: {key['key']}")
    print("The secret is shown only this once: only its hash is stored. Keep it safe.")


def keys_list(args: argparse.Namespace, client: APIClient) -> None:
    params = present(limit=args.limit)
    print_pages(client, "/v1/api-keys", params, args.all, ApiKeyPublic, key_row, KEY_HEADER)


def keys_revoke(args: argparse.Namespace, client: APIClient) -> None:
    key = client.call("DELETE", f"/v1/api-keys/{segment(args.key_id)}")
    print(f"revoked {key['id']} ({key['name']}) at {key['revokedAt']} by {key['revokedBy']}")


def queues_list(args: argparse.Namespace, client: APIClient) -> None:
    queues = client.call("GET", "/v1/queues")["items"]
    print(QUEUE_HEADER)
    for queue in queues:
        print(queue_row(queue))


def queues_act(args: argparse.Namespace, client: APIClient) -> None:
    """pause, resume: a POST to the queue's action, with the reason when given."""
    body = present(reason=args.reason)
    queue = client.call("POST", f"/v1/queues/{segment(args.queue)}/{args.action}", json=body)
    print(QUEUE_HEADER)
    print(queue_row(queue))
