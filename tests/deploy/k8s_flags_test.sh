#!/usr/bin/env bash
# The deployment files parse (YAML, nginx -t) and every sdm-server flag they pass exists in
# `sdm-server --help`: deploy/k8s/*.yaml (the flags ConfigMap, container args) and
# deploy/sdm-server.flags. The YAML check needs Python's yaml module, the nginx check nginx;
# each is skipped (and said so) without it.
#
#   tests/deploy/k8s_flags_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
# Debian installs nginx in /usr/sbin, which a non-root user's PATH lacks: the test would skip.
export PATH="$PATH:/usr/sbin:/sbin"
BUILD_DIR=$1
SOURCE_DIR=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$BUILD_DIR/server/sdm-server" --help >"$work/help.txt" 2>&1 || true
grep -q -- "--state_dir" "$work/help.txt" || { echo "FAIL: sdm-server --help"; exit 1; }

if python3 -c 'import yaml' 2>/dev/null; then
  python3 - "$SOURCE_DIR"/deploy/k8s/*.yaml <<'PY' >"$work/flags.txt"
import re, sys, yaml
for path in sys.argv[1:]:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for doc in docs:
        assert "kind" in doc and "apiVersion" in doc, f"{path}: a document without kind/apiVersion"
        def walk(node):
            if isinstance(node, dict):
                for v in node.values(): yield from walk(v)
            elif isinstance(node, list):
                for v in node: yield from walk(v)
            elif isinstance(node, str):
                yield node
        kind = doc["kind"]
        name = doc["metadata"]["name"]
        if kind == "ConfigMap" and name != "sdm-server-flags":
            continue  # the router's nginx snippets
        for text in walk(doc):
            for flag in re.findall(r"(?m)(?:^|\s|\")--([a-z_]+)", text):
                print(path, flag)
PY
  echo "ok: deploy/k8s/*.yaml parse"
else
  echo "skip: python3 yaml module missing, the manifests' syntax is not checked"
fi
if python3 -c 'import yaml' 2>/dev/null; then
  # The router's upstreams name each replica's own Service (stable addresses: nginx resolves its
  # upstreams once), one per StatefulSet replica, selecting that pod on the gRPC port (and, for
  # the HTTP front, on the port the StatefulSet names http, which the ConfigMap's --http_port is).
  python3 - "$SOURCE_DIR/deploy/k8s" <<'PY'
import re, sys, yaml
d = sys.argv[1]
docs = {}
for name in ("router.yaml", "services.yaml", "statefulset.yaml"):
    for doc in yaml.safe_load_all(open(f"{d}/{name}")):
        if doc:
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
sts = docs[("StatefulSet", "sdm-server")]
replicas = sts["spec"]["replicas"]
container_ports = {p["name"]: p["containerPort"]
                   for p in sts["spec"]["template"]["spec"]["containers"][0]["ports"]}
flags = yaml.safe_load(open(f"{d}/configmap.yaml"))["data"]["sdm-server.flags"]
http_flag = re.search(r"(?m)^--http_port=(\d+)", flags)
assert http_flag and int(http_flag.group(1)) == container_ports["http"], \
    f"--http_port in the ConfigMap is not the StatefulSet's http port {container_ports['http']}"
for conf, port_name in (("sdm-upstreams.conf", "grpc"), ("sdm-http-upstreams.conf", "http")):
    upstreams = docs[("ConfigMap", "sdm-router")]["data"][conf]
    hosts = re.findall(r"(?m)^\s*server\s+([^:\s]+):(\d+)", upstreams)
    assert len(hosts) == replicas, f"{conf}: {len(hosts)} upstreams for {replicas} replicas"
    for i, (host, port) in enumerate(sorted(hosts)):
        svc = docs.get(("Service", host))
        assert svc is not None, f"upstream {host}: no Service of that name in services.yaml"
        assert svc["spec"].get("clusterIP") != "None", f"{host}: headless (pod addresses change)"
        pod = svc["spec"]["selector"].get("statefulset.kubernetes.io/pod-name")
        assert pod == f"{sts['metadata']['name']}-{i}", f"{host} selects {pod}"
        svc_ports = {p["port"]: p for p in svc["spec"]["ports"]}
        assert int(port) in svc_ports, f"{conf}: {host} has no port {port}"
        target = svc_ports[int(port)].get("targetPort", int(port))
        assert target in (container_ports[port_name], port_name), \
            f"{conf}: {host}:{port} does not reach the replica's {port_name} port"
    print(f"ok: the router's {len(hosts)} {port_name} upstreams are one Service per replica")
# Only the router reaches the API ports (httplib bounds no request head: docs/api.md).
policy = [doc for doc in yaml.safe_load_all(open(f"{d}/networkpolicy.yaml")) if doc][0]
assert policy["spec"]["podSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"], \
    "the NetworkPolicy does not select the replicas"
router_labels = docs[("Deployment", "sdm-router")]["spec"]["template"]["metadata"]["labels"]
for name in ("grpc", "http"):
    allowed = [rule for rule in policy["spec"]["ingress"]
               if any(p["port"] == container_ports[name] for p in rule["ports"])]
    assert allowed, f"the NetworkPolicy lets nobody reach the {name} port"
    for rule in allowed:
        for peer in rule["from"]:
            labels = peer.get("podSelector", {}).get("matchLabels")
            assert labels and labels.items() <= router_labels.items(), \
                f"the {name} port is open to more than the router: {peer}"
print("ok: only the router reaches the replicas' gRPC and HTTP ports")
PY
fi
sed -n 's/^--\([a-z_]*\).*/deploy\/sdm-server.flags \1/p' "$SOURCE_DIR/deploy/sdm-server.flags" \
  >>"$work/flags.txt"
[ -s "$work/flags.txt" ] || { echo "FAIL: no flags found in the deployment files"; exit 1; }
bad=0
while read -r file flag; do
  [ "$flag" = flagfile ] && continue  # absl's own
  grep -q -- "^  --$flag " "$work/help.txt" || { echo "FAIL: $file passes --$flag, unknown to sdm-server"; bad=1; }
done <"$work/flags.txt"
[ $bad -eq 0 ] || exit 1
echo "ok: $(wc -l <"$work/flags.txt") flags in the deployment files exist in sdm-server --help"

# The flags of the ConfigMap together pass sdm-server's usage checks (exit 2 is a usage error,
# e.g. --session_ttl with --shared_state_dir); with no model there it then stops at the model
# (or at etcd, unreachable here) with exit 1. Paths are moved under $work.
if python3 -c 'import yaml' 2>/dev/null; then
  python3 - "$SOURCE_DIR/deploy/k8s/configmap.yaml" >"$work/configmap.flags" <<'PY'
import sys, yaml
for doc in yaml.safe_load_all(open(sys.argv[1])):
    if doc and doc.get("kind") == "ConfigMap" and doc["metadata"]["name"] == "sdm-server-flags":
        print(doc["data"]["sdm-server.flags"])
PY
  printf 'sk-0123456789abcdef tenant-a\n' >"$work/api_keys"
  chmod 0400 "$work/api_keys"
  status=0
  timeout 60 "$BUILD_DIR/server/sdm-server" --flagfile="$work/configmap.flags" \
    --model="$work/no-model" --state_dir="$work/state" --port=0 --metrics_port=-1 --http_port=0 \
    --api_keys="$work/api_keys" >"$work/configmap.out" 2>&1 || status=$?
  [ "$status" -ne 2 ] || { cat "$work/configmap.out"; echo "FAIL: the ConfigMap's flags are refused"; exit 1; }
  [ "$status" -ne 0 ] || { echo "FAIL: sdm-server started without a model"; exit 1; }
  [ "$status" -eq 1 ] ||
    { cat "$work/configmap.out"; echo "FAIL: sdm-server exited $status (hung or crashed?), not 1"; exit 1; }
  # absl's flag parser also exits 1 (a value that does not parse, an unknown flag): the exit must
  # come from the model (or etcd), after every flag was read.
  if grep -Eq "Illegal value|Unknown command line flag|ERROR:" "$work/configmap.out" ||
     ! grep -Eq "cannot load the model|etcd" "$work/configmap.out"; then
    cat "$work/configmap.out"; echo "FAIL: the ConfigMap's flags did not all parse"; exit 1
  fi
  echo "ok: the ConfigMap's flags pass sdm-server's usage checks (exit $status: no model here)"
  # Tenancy is on: the ConfigMap names a key file, which a Secret the pods cannot start without
  # provides, readable by owner and group only.
  python3 - "$SOURCE_DIR/deploy/k8s" <<'PY'
import re, sys, yaml
d = sys.argv[1]
flags = yaml.safe_load(open(f"{d}/configmap.yaml"))["data"]["sdm-server.flags"]
keys = re.search(r"(?m)^--api_keys=(\S+)", flags)
assert keys, "the ConfigMap passes no --api_keys: every caller would be the tenant 'default'"
path = keys.group(1)
sts = [doc for doc in yaml.safe_load_all(open(f"{d}/statefulset.yaml")) if doc][0]
pod = sts["spec"]["template"]["spec"]
volumes = {v["name"]: v for v in pod["volumes"]}
mounts = [m for m in pod["containers"][0]["volumeMounts"]
          if path.startswith(m["mountPath"].rstrip("/") + "/")]
assert mounts, f"--api_keys={path}: no volume is mounted there"
secret = volumes[mounts[0]["name"]].get("secret")
assert secret, f"--api_keys={path}: the volume there is not a Secret"
assert not secret.get("optional", False), "the API key Secret is optional: pods would start without keys"
assert secret.get("defaultMode", 0o644) & 0o007 == 0, "the API key Secret is readable by others"
print(f"ok: --api_keys={path} comes from the Secret {secret['secretName']}")
PY
fi

if command -v nginx >/dev/null; then
  mkdir -p "$work/nginx/conf" "$work/nginx/logs" "$work/nginx/tmp"
  cp "$SOURCE_DIR/deploy/nginx/nginx.conf" "$work/nginx/conf/"
  cp "$SOURCE_DIR/deploy/nginx/sdm-listen.conf.example" "$work/nginx/conf/sdm-listen.conf"
  cp "$SOURCE_DIR/deploy/nginx/sdm-http-listen.conf.example" "$work/nginx/conf/sdm-http-listen.conf"
  # The examples name Kubernetes hosts; nginx -t resolves them, so check with loopback ones.
  sed 's/sdm-replica-[0-9]/127.0.0.1/' "$SOURCE_DIR/deploy/nginx/sdm-upstreams.conf.example" \
    | awk '{ sub(/:50051/, ":" 50051 + NR); print }' >"$work/nginx/conf/sdm-upstreams.conf"
  sed 's/sdm-replica-[0-9]/127.0.0.1/' "$SOURCE_DIR/deploy/nginx/sdm-http-upstreams.conf.example" \
    | awk '{ sub(/:8080/, ":" 8080 + NR); print }' >"$work/nginx/conf/sdm-http-upstreams.conf"
  nginx -t -q -p "$work/nginx" -c conf/nginx.conf -e "$work/nginx/logs/error.log" 2>&1 ||
    { echo "FAIL: nginx -t on deploy/nginx/nginx.conf"; exit 1; }
  echo "ok: deploy/nginx/nginx.conf passes nginx -t"
else
  echo "skip: nginx missing, deploy/nginx/nginx.conf not checked"
fi
