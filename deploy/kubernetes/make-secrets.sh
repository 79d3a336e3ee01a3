#!/usr/bin/env bash
# Make the Secrets deploy/kubernetes reads: a CA, the etcd members' certificate (server and
# peer), client certificates for etcd's root (the Jobs) and for the hub (user tensorhub;
# under --client-cert-auth etcd takes a certificate's CN as its user), the hub user's etcd
# password and the hub's admin token.
#   deploy/kubernetes/make-secrets.sh DIR            files only, into DIR (keep ca.key safe)
#   deploy/kubernetes/make-secrets.sh DIR --apply    and create the Secrets with kubectl
# NAMESPACE (default tensorhub) and REPLICAS (default 3) must match kustomization.yaml and
# the StatefulSet. gRPC clients (the hub) accept no wildcard one level under a bare name, so
# every member is named in the certificate.
set -euo pipefail
dir=${1:?usage: make-secrets.sh DIR [--apply]}
ns=${NAMESPACE:-tensorhub}
replicas=${REPLICAS:-3}
mkdir -p "$dir" && cd "$dir"
umask 077

sans="DNS:localhost,IP:127.0.0.1"
for ((i = 0; i < replicas; i++)); do
  m=tensorhub-etcd-$i.tensorhub-etcd
  sans+=",DNS:$m,DNS:$m.$ns.svc,DNS:$m.$ns.svc.cluster.local"
done

sign() {  # NAME CN EXTENSIONS: NAME.key and NAME.crt, signed by the CA
  openssl req -new -newkey rsa:2048 -nodes -subj "/CN=$2" -keyout "$1.key" -out "$1.csr" 2>/dev/null
  printf '%b\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 825 \
    -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

test -f ca.crt || openssl req -x509 -newkey rsa:2048 -nodes -days 3650 \
  -subj "/CN=tensorhub-etcd-ca" -keyout ca.key -out ca.crt 2>/dev/null
sign member tensorhub-etcd "subjectAltName=$sans\nextendedKeyUsage=serverAuth,clientAuth"
sign root root "extendedKeyUsage=clientAuth"
sign hub tensorhub "extendedKeyUsage=clientAuth"
test -f etcd-password || openssl rand -hex 24 | tr -d "\n" > etcd-password  # no newline: etcdctl would keep it
test -f admin-token || openssl rand -hex 24 | tr -d "\n" > admin-token
echo "files in $dir: ca.crt ca.key member.* root.* hub.* etcd-password admin-token"

if [ "${2:-}" = --apply ]; then
  k() { kubectl -n "$ns" create secret generic "$@" --dry-run=client -o yaml | kubectl apply -f -; }
  kubectl apply -f "$(dirname "$(readlink -f "$0")")/namespace.yaml"
  k tensorhub-etcd-tls --from-file=ca.crt --from-file=tls.crt=member.crt --from-file=tls.key=member.key
  k tensorhub-etcd-root --from-file=ca.crt --from-file=tls.crt=root.crt --from-file=tls.key=root.key
  k tensorhub-etcd-hub --from-file=ca.crt --from-file=tls.crt=hub.crt --from-file=tls.key=hub.key \
    --from-file=password=etcd-password
  k tensorhub-admin --from-file=token=admin-token
fi
