# kvrouter, kvmocker and kvbench on Debian 12, built from Debian's packages only.
FROM debian:12
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \
      cmake g++ ninja-build pkg-config ca-certificates \
      libnats-dev libmsgpack-cxx-dev libconcurrentqueue-dev libfmt-dev libboost-program-options-dev \
      libgtest-dev libgmock-dev libbenchmark-dev libxxhash-dev nlohmann-json3-dev \
      prometheus-cpp-dev libcivetweb-dev libzmq3-dev cppzmq-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVROUTER_BENCH=OFF \
    && cmake --build /build --target kvrouter kvmocker kvbench kvrelay \
    && cp /build/bin/kvrouter /build/bin/kvmocker /build/bin/kvbench /build/bin/kvrelay /usr/local/bin/
# Every flag can also be set with DYN_<FLAG> / NATS_SERVER in the environment.
ENV NATS_SERVER=nats://nats:4222
CMD ["kvrouter"]
