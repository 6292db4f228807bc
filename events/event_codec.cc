#include "events/event_codec.h"
