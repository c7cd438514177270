extern "C" int ember_placeholder() { return 0; }
