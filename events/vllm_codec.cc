#include "events/vllm_codec.h"
