# Prometheus from Debian's package, for machines that cannot pull
# prom/prometheus (deploy/local-images.sh builds it as PROMETHEUS_IMAGE). Like
# the official image: the prometheus binary is the entrypoint, data in
# /prometheus, and wget for the compose health check.
ARG BASE_IMAGE=pagedkv-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
WORKDIR /prometheus
VOLUME /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
