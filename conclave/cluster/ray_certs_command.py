"""``conclave ray-certs DIR [--ca CA_DIR] [--hosts HOST ...]``: certificates for Ray's TLS.

Without ``--ca`` it creates the cluster's CA in DIR (``ca.pem``, ``ca.key``: keep the key with
whoever admits nodes, never on an owner's machine). With ``--hosts`` it also writes a node's
certificate and key (``node.pem``, ``node.key``, and the CA's ``ca.pem``) into DIR, signed by
that CA or by the one in CA_DIR, naming the node's IP addresses or DNS names (and loopback, which
a node's own processes dial). It prints the settings every Ray process of that node, and the
driver, must run with. ``--owner NAME``: the certificate names the owner (its common name), as an
owner's gateway certificate must (``conclave owner serve``, docs/gateway.md).
"""
from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from conclave.cluster.tls import (LOOPBACK_NAMES, CertificateError, create_authority, issue, load_authority,
                                  subject_alternative_name)
from conclave.errors import fail


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("directory", type=Path, help="where to write (created, mode 700)")
    parser.add_argument("--ca", type=Path, metavar="CA_DIR",
                        help="sign with the CA already in CA_DIR (default: create a new CA in DIRECTORY)")
    parser.add_argument("--hosts", nargs="+", default=(), metavar="HOST",
                        help="the node's IP addresses or DNS names, as the other nodes reach it")
    parser.add_argument("--days", type=int, default=365, help="validity of what is written (default 365)")
    parser.add_argument("--owner", default=None, metavar="NAME",
                        help="the certificate's common name: the owner whose gateway it serves (default: the first host)")


def main(args: argparse.Namespace) -> int:
    if (args.ca is not None or args.owner is not None) and not args.hosts:
        return fail(CertificateError("--ca and --owner go with a node's certificate: give the node's --hosts"))
    try:
        hosts = tuple(dict.fromkeys((*args.hosts, *LOOPBACK_NAMES))) if args.hosts else ()
        for host in hosts:
            subject_alternative_name(host)  # checked before anything is written
        authority = load_authority(args.ca) if args.ca is not None else create_authority(args.directory, days=args.days)
        if args.ca is None:
            print(f"CA: {authority.certificate} (give it to every node) and {authority.key} (keep it here)")
        if hosts:
            node = issue(authority, args.directory, hosts, days=args.days, common_name=args.owner)
            print(f"node certificate for {', '.join(hosts)}: {node.certificate}, key {node.key}")
            print("run ray start, and the driver, on that node with:")
            print("export " + " ".join(f"{name}={shlex.quote(value)}" for name, value in node.ray_env().items()))
    except (OSError, ValueError) as err:  # CertificateError is a ValueError
        return fail(CertificateError(str(err).splitlines()[0]))
    return 0
