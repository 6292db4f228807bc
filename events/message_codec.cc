#include "events/message_codec.h"
