# Redis from Debian's package, for machines that cannot pull redis:7-alpine
# (deploy/local-images.sh builds it as REDIS_IMAGE). Like the official image:
# runs as `redis`, keeps its files in /data, `redis-server` by default.
# Debian's build keeps protected mode on (the official image compiles it off):
# docker-compose.yml passes --protected-mode no, Redis being reachable on the
# compose network only.
ARG BASE_IMAGE=pagedkv-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
VOLUME /data
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
