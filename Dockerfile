# kvrouter, kvgateway, kvmocker, kvbench and kvrelay on Debian 12, from Debian's packages only.
# Three stages: `runtime` holds only the shared libraries the programs load; `build` has the
# toolchain and compiles; the final image is `runtime` plus the stripped binaries (about
# 110 MB; scripts/compose-check.sh fails it above 200 MB).
FROM debian:12 AS runtime
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \
      libnats3.4 libfmt9 libboost-program-options1.74.0 libxxhash0 \
      libprometheus-cpp-core1.0 libsimdjson14 libcivetweb1 libzmq5 libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
# Every flag can also be set with DYN_<FLAG> / NATS_SERVER in the environment.
ENV NATS_SERVER=nats://nats:4222
CMD ["kvrouter"]

FROM debian:12 AS build
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \
      cmake g++ ninja-build pkg-config ca-certificates \
      libnats-dev libmsgpack-cxx-dev libconcurrentqueue-dev libfmt-dev libboost-dev libboost-program-options-dev \
      libgtest-dev libgmock-dev libxxhash-dev nlohmann-json3-dev libncurses-dev \
      prometheus-cpp-dev libcivetweb-dev libzmq3-dev cppzmq-dev libsimdjson-dev libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
WORKDIR /src
COPY . .
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVROUTER_BENCH=OFF \
    && cmake --build /build --target kvrouter kvgateway kvmocker kvbench kvrelay \
    && mkdir /out && for p in kvrouter kvgateway kvmocker kvbench kvrelay; do strip -o /out/$p /build/bin/$p; done

FROM runtime
COPY --from=build /out/ /usr/local/bin/
